"""Llama-family (Llama, SmolLM, Mistral) and Qwen2 decoder over the paged KV pool.

All tokens of a batch are flattened into one `[T, hidden]` tensor so every projection is a single
matmul regardless of how many sequences the batch holds; only attention looks at sequence
boundaries. Q/K/V and gate/up are fused into one linear each at load time.

Tensor-parallel layout (not implemented yet, but the module structure is ready for it): `qkv_proj`
and `gate_up_proj` are column-parallel (each rank would own a slice of heads / of the intermediate
dimension, sliced per fused part), `o_proj` and `down_proj` are row-parallel followed by an
all-reduce. `num_heads`/`num_kv_heads` on the attention module are the per-rank counts.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.decode_attention import (
    DecodeGroups,
    grouped_decode_attention,
    plan_decode_groups,
)
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

# The RoPE table grows on demand past this length, so a 128k-context model does not pay for the
# full table up front.
_INITIAL_ROPE_LEN = 16384


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-frequency inverse wavelengths `[head_dim // 2]` (float32), with scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(
        f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3, freq_factors"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band between
    # is interpolated smoothly in wavelength.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, with a matrix-vector path for one bf16 row on CPU.

    oneDNN's bf16 GEMM is poorly tuned for a single row (batch-1 decode); `torch.mv` was measured
    ~1.3x faster there, ~15% of a whole SmolLM2 decode step.
    """
    if x.shape[0] == 1 and x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        y = torch.mv(weight, x[0]).unsqueeze(0)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` using `linear` (same parameters and state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, in] -> [T, out]`."""
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension; statistics are accumulated in float32."""
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


@dataclass
class _SeqAttn:
    """Per-sequence EXTEND attention plan, shared by all layers with the same window."""

    seq: int  # index in the batch
    start: int
    end: int
    prefix_len: int
    # None = plain causal; else a lower-right causal bias or an [extend_len, seq_len] bool mask.
    mask: torch.Tensor | CausalBias | None


class AttentionPlan:
    """Masks derived from a batch once per forward, reused by every layer.

    Layers with a sliding window need different masks than full-attention layers; plans are
    built per distinct window on first use.
    """

    def __init__(self, batch: ForwardBatch, device: torch.device) -> None:
        self.batch = batch
        self.device = device
        self._extend: dict[int | None, list[_SeqAttn]] = {}
        self._decode: dict[int | None, torch.Tensor | None] = {}
        self._groups: DecodeGroups | None | bool = False  # False = not computed yet

    def decode_groups(self) -> DecodeGroups | None:
        """Groups of DECODE rows sharing a prefix (computed once per forward), or None."""
        if self._groups is False:
            b = self.batch
            assert b.padded_slots is not None and b.padded_mask is not None
            self._groups = plan_decode_groups(b.padded_slots, b.padded_mask)
        return self._groups  # type: ignore[return-value]

    def extend(self, window: int | None) -> list[_SeqAttn]:
        """Per-sequence slices and masks for EXTEND attention with the given window."""
        if window not in self._extend:
            plans, start = [], 0
            b = self.batch
            batched = set(b.decode_seqs or ())
            lens = zip(b.prefix_lens, b.extend_lens, b.seq_lens, strict=True)
            for i, (prefix, ext, total) in enumerate(lens):
                if i in batched:  # served by the decode path
                    start += ext
                    continue
                mask: torch.Tensor | CausalBias | None = None
                if window is None and prefix > 0:
                    # Causal aligned to the end: query j sees keys 0..prefix+j. SDPA handles this
                    # without materializing a mask (measured 1.5x faster than a bool mask).
                    mask = causal_lower_right(ext, total)
                elif window is not None and (prefix > 0 or total > window):
                    q_pos = torch.arange(prefix, total, device=self.device)[:, None]
                    k_pos = torch.arange(total, device=self.device)[None, :]
                    mask = k_pos <= q_pos
                    if window is not None:
                        mask &= k_pos > q_pos - window
                plans.append(_SeqAttn(i, start, start + ext, prefix, mask))
                start += ext
            self._extend[window] = plans
        return self._extend[window]

    def decode(self, window: int | None) -> torch.Tensor | None:
        """`[B, 1, 1, L]` bool mask for DECODE attention, or None when nothing is masked."""
        if window not in self._decode:
            b = self.batch
            lens = b.decode_seq_lens
            windowed = window is not None and max(lens) > window
            if not windowed and min(lens) == max(lens):
                mask = None  # every row is full: skip masking entirely
            else:
                assert b.padded_mask is not None
                mask = b.padded_mask
                if windowed:
                    seq = torch.tensor(lens, device=self.device)[:, None]
                    k_pos = torch.arange(mask.shape[1], device=self.device)[None, :]
                    mask = mask & (k_pos > seq - 1 - window)
                mask = mask[:, None, None, :]
            self._decode[window] = mask
        return self._decode[window]


class LlamaAttention(nn.Module):
    """Self-attention with fused QKV, RoPE, GQA, reading and writing the paged KV pool."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.window = config.layer_sliding_window(layer_id)
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        plan: AttentionPlan,
        pool: KVPool,
    ) -> torch.Tensor:
        """`x` is `[T, hidden]`; `cos`/`sin` are `[T, 1, head_dim // 2]` for the T positions."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # Rotate q and k together: one set of elementwise ops instead of two.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, -1)
        qk = _apply_rope(qk, cos, sin)
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        k_cache = pool.k[self.layer_id]
        v_cache = pool.v[self.layer_id]
        k_cache.index_copy_(0, batch.out_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, batch.out_slots, v.to(v_cache.dtype))
        if batch.mode is ForwardMode.DECODE:
            out = self._decode(q, k_cache, v_cache, batch, plan)
        else:
            out = self._extend(q, k, v, k_cache, v_cache, batch, plan)
            if batch.decode_rows is not None:
                rows = batch.decode_rows
                single = self._decode(q.index_select(0, rows), k_cache, v_cache, batch, plan)
                out.index_copy_(0, rows, single)
        return self.o_proj(out)

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        seqs = plan.extend(self.window)
        if batch.decode_rows is None and len(seqs) == 1:
            out = None  # one sequence: its output is the whole result, no copy needed
        else:
            out = q.new_empty(q.shape[0], self.num_heads, self.head_dim)
        for seq in seqs:
            qi = q[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
            if seq.prefix_len == 0:
                # Nothing cached: the fresh K/V are exactly what the pool now holds.
                ki, vi = k[seq.start : seq.end], v[seq.start : seq.end]
            else:
                slots = batch.kv_slots[seq.seq]
                ki, vi = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
            ki = ki.transpose(0, 1).unsqueeze(0).to(q.dtype)
            vi = vi.transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qi,
                ki,
                vi,
                attn_mask=seq.mask,
                is_causal=seq.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            if out is None:
                return o[0].transpose(0, 1).reshape(q.shape[0], self.q_size)
            out[seq.start : seq.end] = o[0].transpose(0, 1)
        assert out is not None
        return out.view(q.shape[0], self.q_size)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        assert batch.padded_slots is not None
        bsz = q.shape[0]
        groups = plan.decode_groups() if self.window is None else None
        if groups is not None:
            out = grouped_decode_attention(q, k_cache, v_cache, groups, self.scale)
            return out.reshape(bsz, self.q_size)
        ks = k_cache[batch.padded_slots].transpose(1, 2).to(q.dtype)  # [B, kv_heads, L, D]
        vs = v_cache[batch.padded_slots].transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, heads, 1, D]
            ks,
            vs,
            attn_mask=plan.decode(self.window),
            scale=self.scale,
            enable_gqa=True,
        )
        return o.reshape(bsz, self.q_size)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotate-half layout (Hugging Face): pairs are (i, i + head_dim/2).
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused into one projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, hidden] -> [T, hidden]`."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual connection."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        plan: AttentionPlan,
        pool: KVPool,
    ) -> torch.Tensor:
        """One block over the flattened tokens `[T, hidden]`."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, plan, pool)
        return h + self.mlp(self.post_attention_layernorm(h))


# Hugging Face checkpoint names of the parts that are fused here: (fused param, part index).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


class CausalLM(nn.Module):
    """Decoder-only LM: `forward(batch, pool)` returns float32 logits of `batch.logit_rows`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i) for i in range(config.num_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    @classmethod
    def empty(cls, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
        """A model with uninitialized weights on `device`, ready for `load_weights`.

        Built on the meta device first so no time is spent on random initialization.
        """
        with torch.device("meta"):
            model = cls(config).to(dtype)  # casting on meta allocates nothing
        model = model.to_empty(device=device)
        model.requires_grad_(False)
        model.eval()
        model._build_rope(_initial_rope_len(config))
        return model

    @property
    def device(self) -> torch.device:
        """Device holding the weights."""
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights (and of activations)."""
        return self.embed_tokens.weight.dtype

    def _build_rope(self, length: int) -> None:
        inv_freq = rope_inv_freq(self.config).to(self.device)
        positions = torch.arange(length, dtype=torch.int64, device=self.device).to(torch.float32)
        freqs = torch.outer(positions, inv_freq)
        # Stored in the activation dtype, as Hugging Face casts cos/sin before rotating.
        self.rope_cos = freqs.cos().to(self.dtype)
        self.rope_sin = freqs.sin().to(self.dtype)

    def lm_head_weight(self) -> torch.Tensor:
        """The output projection, which is the embedding matrix when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Run all layers over the batch, write its K/V into `pool`, return `[R, vocab]` logits."""
        needed = max(batch.seq_lens)
        if needed > self.rope_cos.shape[0]:
            self._build_rope(max(needed, 2 * self.rope_cos.shape[0]))
        cos = self.rope_cos[batch.positions].unsqueeze(1)
        sin = self.rope_sin[batch.positions].unsqueeze(1)
        plan = AttentionPlan(batch, self.device)
        h = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, batch, plan, pool)
        h = self.norm(h[batch.logit_rows])
        return linear(h, self.lm_head_weight()).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters.

        Raises ValueError on a shape mismatch or when some parameter was never provided.
        """
        params = dict(self.named_parameters())
        filled: dict[str, set[int]] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("lm_head.") and self.lm_head is None:
                continue  # tied: the embedding is the output projection
            if name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            target, part = self._map_name(name)
            if target not in params:
                logger.warning("ignoring unexpected checkpoint tensor %s", name)
                continue
            param = params[target]
            dest = param.data if part is None else self._part(target, param, part)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled.setdefault(target, set()).add(-1 if part is None else part)
        missing = []
        for target in params:
            parts = filled.get(target, set())
            expected = {-1} if self._num_parts(target) == 1 else set(range(self._num_parts(target)))
            if parts != expected:
                missing.append(target)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")

    @staticmethod
    def _map_name(name: str) -> tuple[str, int | None]:
        m = _LAYER_NAME.match(name)
        if m is not None:
            layer, module, kind = m.groups()
            if module in _FUSED:
                fused, part = _FUSED[module]
                return f"layers.{layer}.{fused}.{kind}", part
        return name, None

    def _num_parts(self, target: str) -> int:
        if ".qkv_proj." in target:
            return 3
        if ".gate_up_proj." in target:
            return 2
        return 1

    def _part(self, target: str, param: torch.Tensor, part: int) -> torch.Tensor:
        cfg = self.config
        if ".qkv_proj." in target:
            sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        else:
            sizes = [cfg.intermediate_size, cfg.intermediate_size]
        start = sum(sizes[:part])
        return param.data[start : start + sizes[part]]


def _initial_rope_len(config: ModelConfig) -> int:
    return max(1, min(config.max_position_embeddings, _INITIAL_ROPE_LEN))
