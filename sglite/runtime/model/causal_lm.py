"""The decoder-only language model every family runs as: embeddings, `DecoderLayer`s over the
paged KV pool, the final norm and the output projection. Which weights it computes with
(quantized copies, GGUF blocks, layouts) is decided at load time by `weight_policy.py`; the layer
cut of a self-speculative draft is `early_exit.py`.

All tokens of a batch are flattened into one `[T, hidden]` tensor so every projection is a single
matmul regardless of how many sequences the batch holds; only attention looks at sequence
boundaries. Q/K/V and gate/up are fused into one linear each at load time, and the elementwise
work between matmuls runs as fused passes (`kernels`): residual add + RMSNorm, RoPE + KV store,
the gated activation. The residual stream is one tensor updated in place across layers.

Tensor parallelism (`distributed/sharding.py`): `qkv_proj` and `gate_up_proj` are
column-parallel (each rank owns a slice of heads / of the intermediate dimension, sliced per fused
part), `o_proj` and `down_proj` are row-parallel followed by an all-reduce, the embedding and the
output projection are split by vocabulary rows. `self.config` is the rank's own config (its
heads and MLP width); `num_heads`/`num_kv_heads` on the attention module are per-rank counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.distributed.parallel import SINGLE, TensorParallelGroup
from sglite.runtime.distributed.sharding import TensorParallelPlan
from sglite.runtime.model import early_exit, kernels, row_forward, weight_policy
from sglite.runtime.model.attention import AttentionPlan
from sglite.runtime.model.checkpoint import CheckpointLoader
from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.cpu_features import cpu_has_amx
from sglite.runtime.model.forward_batch import (
    ForwardBatch,
    ForwardMode,
    RowNarrowing,
    narrow_rows,
)
from sglite.runtime.model.gguf_weight import GGUFWeight
from sglite.runtime.model.layers.decoder_layer import DecoderLayer
from sglite.runtime.model.layers.norm import RMSNorm
from sglite.runtime.model.linear import Linear
from sglite.runtime.model.linear_weight import LinearWeight
from sglite.runtime.model.native_decode import NativeDecoder
from sglite.runtime.model.quantized_weight import QuantizedWeight
from sglite.runtime.model.rope import RopeSet


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter and buffer of `model` uninitialized storage on `device`
    (floating ones in `dtype`); tied parameters stay tied.

    `Module.to_empty` would do this through `empty_like` on meta tensors, whose Python meta
    kernel imports sympy and torch.fx on first use, heavy imports every start-up would pay.
    """
    made: dict[int, torch.Tensor] = {}

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            kind = dtype if t.is_floating_point() else t.dtype
            new = torch.empty(t.shape, dtype=kind, device=device)
            made[id(t)] = (
                nn.Parameter(new, requires_grad=False) if isinstance(t, nn.Parameter) else new
            )
        return made[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = fresh(t)


class CausalLM(nn.Module):
    """Decoder-only LM: `forward(batch, pool)` returns float32 logits of `batch.logit_rows`."""

    def __init__(
        self,
        config: ModelConfig,
        tp_plan: TensorParallelPlan | None = None,
        tp: TensorParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.tp_plan = tp_plan
        self.tp = tp
        if tp_plan is not None:
            # Every rank's vocabulary width, for gathering the logits.
            self.vocab_widths = tp_plan.vocab_widths(config.vocab_size)
            config = tp_plan.local_config(config)
            vocab_rows = tp_plan.vocab[1] - tp_plan.vocab[0]
        else:
            vocab_rows = config.vocab_size
            self.vocab_widths = [vocab_rows]
        self.config = config
        # `_weight` skips the random init: on the meta device (`empty`) `normal_` runs a Python
        # meta kernel whose first call imports torch._dynamo, a heavy import every start-up
        # would pay.
        weight = torch.empty(vocab_rows, config.hidden_size)
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList([DecoderLayer(config, i, tp) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, vocab_rows, bias=False)
        )
        self.ropes: RopeSet | None = None
        # Gemma scales its embeddings; rounded to the weights' dtype as transformers does.
        self.embedding_multiplier = config.embedding_multiplier
        # Set by weight_policy.py at load: the output projection's quantized copy and the row
        # count up to which it serves, the weight object the logits are computed with (None:
        # decided from those on use), and the embedding as a GGUF file stores it (None: the
        # `embed_tokens` parameter).
        self.lm_head_quantized: QuantizedWeight | None = None
        self.lm_head_quantized_max_rows = 0
        self.output_weight: LinearWeight | None = None
        self.embedding_blocks: GGUFWeight | None = None
        # Small DECODE batches run their layers in one native call (native_decode.py); built on
        # first use, after any quantization. False = not built yet; None = not available.
        self.use_native_decode = True
        self._native_decoder: NativeDecoder | None | bool = False
        # Deterministic inference (`enable_deterministic`): every forward as rows.
        self.deterministic = False
        # bf16 EXTEND attention by the native kernel, except where SDPA runs on AMX tiles.
        self.native_extend_attention = not cpu_has_amx()

    @classmethod
    def empty(
        cls,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_plan: TensorParallelPlan | None = None,
        tp: TensorParallelGroup = SINGLE,
    ) -> CausalLM:
        """A model (this rank's shard of it, with `tp_plan`) with uninitialized weights on
        `device`, ready for `load_weights`.

        Built on the meta device first so no time is spent on random initialization.
        """
        with torch.device("meta"):
            model = cls(config, tp_plan, tp)
        _materialize(model, dtype, torch.device(device))
        model.requires_grad_(False)
        model.eval()
        model.ropes = RopeSet(config, torch.device(device))
        if config.embedding_multiplier != 1.0:
            scale = torch.tensor(config.embedding_multiplier).to(dtype)
            model.embedding_multiplier = float(scale)
        return model

    @property
    def device(self) -> torch.device:
        """Device holding the weights."""
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights (and of activations)."""
        return self.embed_tokens.weight.dtype

    def lm_head_weight(self) -> torch.Tensor:
        """The output projection, which is the embedding matrix when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Run all layers over the batch, write its K/V into `pool`, return `[R, vocab]` logits
        (and the final hidden states of `batch.hidden_rows` in `batch.hidden`)."""
        assert self.ropes is not None
        self.ropes.ensure(max(batch.seq_lens))
        if self.deterministic:
            return row_forward.forward_rows(self, batch, pool)
        plan = AttentionPlan(batch, self.device, self.native_extend_attention)
        residual = self.input_embeddings(batch)  # a fresh tensor: updated in place
        decoder = self._decoder() if batch.mode is ForwardMode.DECODE else None
        if decoder is None or not decoder.run(residual, batch, pool):
            self._layers_forward(residual, batch, plan, pool)
        if batch.hidden_rows is not None:
            wanted = residual.index_select(0, batch.hidden_rows)
            batch.hidden = kernels.add_rms_norm(
                None, wanted, self.norm.weight, self.norm.eps
            ).float()
        if batch.logit_rows.numel() == 0:  # only hidden states wanted (embeddings)
            return torch.empty(0, self.config.vocab_size, device=self.device)
        h = residual.index_select(0, batch.logit_rows)
        h = kernels.add_rms_norm(None, h, self.norm.weight, self.norm.eps)
        logits = self._lm_head(h, decode=batch.mode is ForwardMode.DECODE)
        return self.tp.all_gather_columns(logits, self.vocab_widths).float()

    @torch.inference_mode()
    def forward_narrowing(
        self, batch: ForwardBatch, pool: KVPool, narrowing: RowNarrowing
    ) -> torch.Tensor:
        """`forward` of a one-sequence EXTEND batch whose rows may shrink between layers: after
        layer i, the rows `narrowing.after_layer` keeps go on (`narrow_rows`); a dropped
        token's K/V in later layers are the ones the pool holds. Returns the logit rows'
        logits. A segment assembly's pass (scheduler/segment_selection.py)."""
        assert self.ropes is not None
        self.ropes.ensure(max(batch.seq_lens))
        plan = AttentionPlan(batch, self.device, self.native_extend_attention)
        residual, batch = self._layers_forward(
            self.input_embeddings(batch), batch, plan, pool, narrowing=narrowing
        )
        h = residual.index_select(0, batch.logit_rows)
        h = kernels.add_rms_norm(None, h, self.norm.weight, self.norm.eps)
        return self._lm_head(h).float()

    def enable_deterministic(self) -> None:
        """Compute every forward (prefill, extend, draft verification, decode) as rows whose
        results depend on their own token and context only (`row_forward.py`). Call after
        `finalize_weights`. Raises ValueError where this model's kernels cannot."""
        decoder = self._decoder()
        row_forward.check_row_forward(self, decoder, self.output_projection())
        assert decoder is not None
        decoder.deterministic = True
        self.deterministic = True

    def output_projection(self) -> LinearWeight:
        """The weight object the logits are computed with."""
        return self.output_weight or weight_policy.output_weight(self, extra_layouts=False)

    def weights_changed(self) -> None:
        """Weights or layers were replaced: the native decode step, built for the old ones'
        pointers, is rebuilt on its next use."""
        self._native_decoder = False

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `ids` (a fresh tensor), scaled as the family wants."""
        residual = self._embed(ids)
        if self.embedding_multiplier != 1.0:
            residual.mul_(self.embedding_multiplier)
        return residual

    def input_embeddings(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's token embeddings, with `batch.input_embeds` (image features) in their
        rows."""
        if not batch.input_embeds:
            return self.embed(batch.input_ids)
        # Image positions hold negative pad ids (multimodal/processor.py), replaced below.
        residual = self.embed(batch.input_ids.clamp(min=0))
        for rows, embeds in batch.input_embeds:
            residual.index_copy_(0, rows.to(residual.device), embeds.to(residual))
        return residual

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_plan is None:
            return self._embedding_rows(ids)
        # Vocabulary-parallel: each rank looks up the ids it owns, zeros elsewhere, then a sum.
        start, end = self.tp_plan.vocab
        mine = (ids >= start) & (ids < end)
        local = self._embedding_rows((ids - start).clamp(0, end - start - 1))
        local.mul_(mine.unsqueeze(1).to(local.dtype))
        return self.tp.all_reduce(local)

    def _embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embedding_blocks is not None:
            return self.embedding_blocks.rows(ids, self.dtype)
        return self.embed_tokens(ids)

    def _layers_forward(
        self,
        residual: torch.Tensor,
        batch: ForwardBatch,
        plan: AttentionPlan,
        pool: KVPool,
        narrowing: RowNarrowing | None = None,
    ) -> tuple[torch.Tensor, ForwardBatch]:
        """All layers; returns the residual stream after the last and the batch of its rows
        (`batch` itself, in place, unless `narrowing` dropped rows)."""
        assert self.ropes is not None
        first = self.layers[0].input_layernorm
        x = kernels.add_rms_norm(None, residual, first.weight, first.eps)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if narrowing is not None:
                narrowing.before_layer(i, batch, pool)
            x = layer(x, residual, batch, plan, pool, self.ropes.for_layer(i))
            keep = None if narrowing is None or i == last else narrowing.after_layer(i, batch, pool)
            if keep is not None:
                x, residual = x.index_select(0, keep), residual.index_select(0, keep)
                batch = narrow_rows(batch, keep)
                plan = AttentionPlan(batch, self.device, self.native_extend_attention)
            if i < last:
                norm = self.layers[i + 1].input_layernorm
                x = kernels.add_rms_norm(x, residual, norm.weight, norm.eps)
            else:
                residual.add_(x)
        return residual, batch

    def _decoder(self) -> NativeDecoder | None:
        if not self.use_native_decode or self.tp.enabled:  # no all-reduce inside the C step
            return None
        if self._native_decoder is False:
            self._native_decoder = NativeDecoder.create(self)
        return self._native_decoder  # type: ignore[return-value]

    def _lm_head(self, h: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """The logits of rows `h`; `decode`: a DECODE batch's (see `matmul_decode`)."""
        head = self.output_weight or weight_policy.output_weight(self, extra_layouts=False)
        return head.matmul_decode(h) if decode else head.matmul(h)

    def weight_bytes(self) -> int:
        """Bytes of every copy of the weights this model holds: parameters (dense weights that
        were not dropped), GEMM layouts and quantized copies."""

        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        total = sum(size(p) for p in self.parameters())
        for module in self.modules():
            if isinstance(module, Linear) and module is not self.lm_head:
                total += module.kernel.nbytes()
        head = self.output_projection()
        total += head.nbytes()
        embedding = self.embedding_blocks
        if embedding is not None and embedding is not getattr(head, "small", head):
            total += embedding.nbytes()
        return total

    def keep_first_layers(self, count: int) -> None:
        """`early_exit.keep_first_layers`: drop every decoder layer after the first `count`
        (a self-speculative draft's cut; scheduler/draft_model.py calls it)."""
        early_exit.keep_first_layers(self, count)

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        on_loaded: Callable[[str], None] | None = None,
        provided: frozenset[str] = frozenset(),
    ) -> None:
        """Copy canonical-named tensors into the (fused) parameters (`CheckpointLoader.load`);
        `provided`: parameters already held otherwise (`weight_policy.use_gguf_blocks`), not
        expected."""
        loader = CheckpointLoader(self, self.tp_plan, self.lm_head is None)
        loader.load(weights, on_loaded, provided)
        self.weights_changed()

    def weight_layouts(self) -> list[str]:
        """`weight_policy.weight_layouts`: the layouts the projections and the output
        projection compute with, sorted (scheduler/process.py reports them)."""
        return weight_policy.weight_layouts(self)
