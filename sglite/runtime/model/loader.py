"""Model loading entry point: resolves the path and dtype, dispatches to the GGUF or Hugging Face
loader, and returns the model with its config and tokenizer."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sglite.runtime.distributed.parallel import SINGLE, TensorParallelGroup
from sglite.runtime.distributed.sharding import TensorParallelPlan
from sglite.runtime.model import weight_policy
from sglite.runtime.model.catalog import default_model_path  # noqa: F401 (re-exported)
from sglite.runtime.model.causal_lm import CausalLM
from sglite.runtime.model.config import ModelConfig
from sglite.runtime.model.linear import Linear
from sglite.runtime.model.load_options import (
    check_quantization,
    resolve_dtype,
    resolve_gguf_activations,
    resolve_quantization,
    serves_gguf_blocks,
)
from sglite.runtime.model.models.base import ModelFamily
from sglite.runtime.model.tokenizer_files import (
    is_gguf,
    load_gguf_tokenizer,
    load_tokenizer_files,
    single_gguf_in,
)
from sglite.runtime.model.weight_policy import (
    KindFor,
    QuantizedSource,
    auto_quantized_max_rows,
)
from sglite.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from sglite.runtime.model.gguf_index import GGUFFile
    from sglite.runtime.model.weight_arena import HugePageMove

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready to run: weights on `device` in `dtype`, its config and tokenizer."""

    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    model_path: str
    dtype: torch.dtype
    device: torch.device
    # Rows up to which the projections use their quantized weights (-1: all, no dense copy);
    # the resolved value of `load_model`'s argument, None for a model not quantized.
    quantized_max_rows: int | None = None
    # The weight quantization in effect: the kinds the projections use joined by "+" (int4,
    # int8, w4a8, int4+int8), or none; `load_model`'s argument with auto resolved.
    quantization: str = "none"
    # How GGUF block weights take their activations: "int8" (each x row rounded, llama.cpp's
    # arithmetic) or "float"; `load_model`'s `gguf_activations` resolved.
    activations: str = "float"
    # The weights read into the process's memory, still to move into 2 MB pages (None: nothing
    # to move): the server's scheduler moves them between its steps and while idle.
    huge_pages: HugePageMove | None = None

    @property
    def weight_format(self) -> str:
        """The quantization with the activations' rounding (e.g. q4_k+q6_k/a8): what the
        model's values depend on (a disk KV cache's key)."""
        return self.quantization + ("/a8" if self.activations == "int8" else "")


def _quantize_when_loaded(
    model: CausalLM,
    kind_for: KindFor,
    max_rows: int,
    source: QuantizedSource | None,
) -> Callable[[str], None]:
    """A `load_weights` hook quantizing each projection (and freeing its dense weight) as soon
    as it is loaded, so a model kept quantized only never holds all its dense weights at once:
    the peak is the quantized model plus about one projection's dense weight."""
    projections = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name != "lm_head"
    }

    def on_loaded(target: str) -> None:
        if target in projections:
            name = target.removesuffix(".weight")
            weight_policy.quantize_projection(model, name, kind_for, max_rows, source)

    return on_loaded


def _resolve_path(model_path: str | None) -> str:
    """None: the default model; an existing path: itself; a known name (`sglite models list`):
    its verified file in the cache (see `catalog.resolve_model_path`)."""
    from sglite.runtime.model.catalog import resolve_model_path

    return resolve_model_path(model_path)


def _kind_for(requested: str, resolved: str, gguf_file: GGUFFile | None) -> KindFor | None:
    """How each projection is quantized (None: the model stays dense)."""
    from sglite.runtime.model.gguf_auto_quantization import gguf_kind_for

    if resolved == "none":
        return None
    if requested == "auto" and gguf_file is not None:
        return gguf_kind_for(gguf_file)
    return lambda names: resolved


def _apply_family_tokens(tokenizer: Tokenizer, family: ModelFamily, config: ModelConfig) -> None:
    """The family's chat template where the files have none, and its stop tokens."""
    if tokenizer.chat_template is None and family.chat_template is not None:
        tokenizer.chat_template = family.chat_template
    # One lookup per stop token: `get_vocab()` would build a dict of the whole vocabulary at
    # every start.
    found = (tokenizer.token_to_id(t) for t in family.stop_tokens)
    extra = [i for i in found if i is not None]
    for eos in [*config.eos_token_ids, *extra]:  # the model's own stop tokens always stop
        if eos not in tokenizer.eos_token_ids:
            tokenizer.eos_token_ids.append(eos)


def _model_family(path: str) -> tuple[ModelFamily, ModelConfig] | None:
    """The family and config of a model path, None for a tokenizer-only directory."""
    from sglite.runtime.model import gguf_loader, hf_loader
    from sglite.runtime.model.gguf_index import open_gguf

    if is_gguf(path):
        gf = open_gguf(path)
        return gguf_loader.gguf_family(gf, path), gguf_loader.gguf_config(gf, path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return hf_loader.hf_config(path)
    return None


def load_tokenizer(path: str | None = None, model_path: str | None = None) -> Tokenizer:
    """The tokenizer of a model path (GGUF file or Hugging Face directory; None = default),
    with the chat template and stop tokens of the model's family where its files lack them
    (`model_path`: the model's own path, when the tokenizer comes from another)."""
    tokenizer = load_tokenizer_files(_resolve_path(path))
    model = _resolve_path(model_path if model_path else path)
    known = _model_family(single_gguf_in(model) or model)
    if known is not None:
        _apply_family_tokens(tokenizer, *known)
    return tokenizer


def _tokenizer_for(path: str, tokenizer_path: str | None, gguf_file: Any) -> Tokenizer:
    if tokenizer_path is None and gguf_file is not None:
        return load_gguf_tokenizer(path, gguf_file)  # reuse the parsed metadata
    return load_tokenizer(tokenizer_path or path)


# The block types tiled by default where the VNNI GEMM serves every product (`_tiled_types`).
TILED_BLOCKS_OF_32 = frozenset({"Q5_0", "Q8_0"})
# The block types tiled where 512-bit operations run as two halves and every product rounds.
TILED_ON_SPLIT_UNITS = frozenset({"Q4_K"})


def _tiled_types(every_product_rounds: bool, draft: bool, batch_invariant: bool) -> frozenset[str]:
    """The block types a model's GGUF parts are tiled in (`gguf_block_weights`; only where x
    is rounded): none on CPUs with AMX tiles (whose GEMM takes the file's rows). Where every
    product rounds x and 512-bit operations run whole, the VNNI GEMM then serves the tiled
    parts at every row count: for `batch_invariant` (deterministic inference) every type it
    tiles (rows independent; cheaper than the GEMV for batches, 6-10% dearer at one row), else
    the blocks of 32 (`TILED_BLOCKS_OF_32`: as fast as their GEMV at one row, far faster at two
    to eight, where the file's rows take a GEMM that decodes them row by row; tiled k-quants
    lose a little at one row). Where they run as two halves (AMD Zen 4), Q4_K
    (`TILED_ON_SPLIT_UNITS`: a tiled Q4_K super-block multiplied as its nibbles are split reads
    as fast as the GEMV at one row and takes 0.7-0.8x its time at three to six; Q6_K's stays
    dearer at one row), and a draft model's Q5_0 (1.1x its GEMV at one row, 1.3x at four);
    else a draft model's Q5_0, or none."""
    from sglite.runtime.model import kernels
    from sglite.runtime.model.gguf_part import TILED_TYPES

    if kernels.amx_available():
        return frozenset()
    split = kernels.vectors_512_split()
    if every_product_rounds and not split:
        return frozenset(TILED_TYPES) if batch_invariant else TILED_BLOCKS_OF_32
    tiled = frozenset({"Q5_0"}) if draft else frozenset()
    if every_product_rounds and split and not batch_invariant:
        tiled |= TILED_ON_SPLIT_UNITS
    return tiled


def default_tiled_types() -> frozenset[str]:
    """The block types a model's GGUF parts are tiled in as a server loads it by default
    (`--dtype auto --quantization auto`, no deterministic inference): every product then
    rounds x where activations resolve to int8."""
    return _tiled_types(resolve_gguf_activations("auto") == "int8", False, False)


def load_model(
    model_path: str | None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    tokenizer_path: str | None = None,
    progress: bool = True,
    quantization: str = "none",
    quantized_max_rows: int | None = None,
    gemm_packing: str = "auto",
    tp: TensorParallelGroup = SINGLE,
    gguf_activations: str = "auto",
    mmap_weights: bool = False,
    gguf_tiles: bool = False,
    batch_invariant: bool = False,
) -> LoadedModel:
    """Load weights, config and tokenizer. `model_path=None` loads the default model.

    `quantization` (none, int8, int4) adds weight-only quantized copies of the projections for
    matmuls of at most `quantized_max_rows` rows (see `weight_policy.quantize`; -1: every matmul,
    and the dense weights are freed; None: `auto_quantized_max_rows`); int4 takes a GGUF's own
    Q4_0/Q4_1/Q4_K values where the file has them; auto picks by the file
    (`resolve_quantization`), and the returned model records what was picked.
    `gemm_packing` (auto, on, off) adds GEMM-friendly copies of the dense weights (see
    `linear.py`) for batches and prefill; auto adds them for models whose weights take at most
    `weight_policy.AUTO_PACK_MAX_BYTES`.
    `gguf_activations` (auto, int8, float): how a GGUF's own blocks take their activations
    (`resolve_gguf_activations`; int8 rounds decode products' x rows as llama.cpp does, and
    prefill's in bfloat16, or in float32 when `dtype` is auto: see `gguf_weight.py`).
    A GGUF's blocks are read into the process's memory (`weight_arena.py`), or with
    `mmap_weights` served from the file's mapping. Where every product rounds x to int8 (int8
    activations, and bfloat16 or float32 as `dtype=auto`'s choice) and the VNNI GEMM serves,
    the parts of blocks of 32 are tiled for it, and with `batch_invariant` (deterministic
    inference) every part it can tile (`_tiled_types`): the GEMM is then their one kernel at
    every row count, its rows independent. `gguf_tiles` (a draft model) tiles its Q5_0
    projections for the VNNI GEMM also where 512-bit operations run as halves, and with int8
    activations every product rounds x, prompt reads included, in float32 too (a draft only
    guesses: its products need not be exact, and its prompt reads take the VNNI GEMM, faster
    than the float GEMMs). Rounding activations on an AVX2 build without VNNI, the projections'
    Q5_0 parts are held in quads for the int8 GEMV (`kernels.gguf_quads_pay`, `GGUFPart.quads`;
    not with `mmap_weights`, whose blocks stay the file's pages).
    With a tensor-parallel group `tp`, only this rank's shard of every weight is kept (each
    checkpoint tensor is read, cut and dropped in turn) and the returned config is the rank's.

    Raises FileNotFoundError for a missing path, ValueError for an unsupported architecture or a
    file that is not valid GGUF/safetensors.
    """
    from sglite.runtime.model import gguf_loader, hf_loader, kernels
    from sglite.runtime.model.gguf_block_weights import gguf_block_weights
    from sglite.runtime.model.gguf_index import open_gguf
    from sglite.runtime.model.weight_arena import WeightArena

    path = _resolve_path(model_path)
    path = single_gguf_in(path) or path
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    gguf_file = None
    if is_gguf(path):
        gguf_file = open_gguf(path)
        family = gguf_loader.gguf_family(gguf_file, path)
        config = gguf_loader.gguf_config(gguf_file, path)
    elif os.path.isdir(path):
        family, config = hf_loader.hf_config(path)
        files = hf_loader.safetensors_files(path)
        weights = family.hf_weights(hf_loader.iter_safetensors_weights(files, progress), config)
    else:
        raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face model directory")
    # The tokenizer loads on a thread while the weights load: importing transformers and
    # reading the tokenizer is mostly Python, the weights mostly torch ops that release the GIL.
    loader = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    tokenizer_job = loader.submit(_tokenizer_for, path, tokenizer_path, gguf_file)
    loader.shutdown(wait=False)
    if quantization != "auto":
        check_quantization(quantization, torch_dtype, dev)
    resolved = resolve_quantization(quantization, gguf_file, torch_dtype, dev)
    kind_for = _kind_for(quantization, resolved, gguf_file)
    plan = TensorParallelPlan.create(config, tp.rank, tp.size) if tp.enabled else None
    model = CausalLM.empty(config, torch_dtype, dev, plan, tp)
    provided: frozenset[str] = frozenset()
    activations = "float"
    arena = None
    if gguf_file is not None:
        consumed: frozenset[str] = frozenset()
        if quantization == "auto" and serves_gguf_blocks(resolved, dev):
            activations = resolve_gguf_activations(gguf_activations)
            arena = None if mmap_weights else WeightArena.for_file(gguf_file)
            rounds = activations == "int8"
            # float32 as auto's choice (a CPU without bf16) rounds its EXTEND products as bf16's do
            float32_rounds = torch_dtype == torch.float32 and (dtype == "auto" or gguf_tiles)
            round_float32_extend = rounds and float32_rounds
            every_product_rounds = torch_dtype == torch.bfloat16 or round_float32_extend
            blocks = gguf_block_weights(
                gguf_file,
                model,
                config,
                plan,
                rounds,
                arena,
                tiled_types=_tiled_types(
                    rounds and every_product_rounds, gguf_tiles, batch_invariant
                ),
                tile_head=not gguf_tiles,
                round_float32_extend=round_float32_extend,
                quads=kernels.gguf_quads_pay(),
            )
            provided = weight_policy.use_gguf_blocks(model, blocks)
            consumed = frozenset(blocks.consumed)
        weights = gguf_loader.iter_gguf_weights(gguf_file, config, progress, consumed)
    quantized_rows = source = head = None
    if kind_for is not None:
        quantized_rows = quantized_max_rows
        if quantized_rows is None:
            quantized_rows = auto_quantized_max_rows(torch_dtype, dev)
        if provided:  # held as the file's blocks, for every row count
            quantized_rows = -1
        elif gguf_file is not None:
            source = gguf_loader.gguf_quantized_source(gguf_file, config)
            head = gguf_loader.gguf_q8_head(gguf_file, plan.vocab if plan else None)
    on_loaded = None
    if kind_for is not None and quantized_rows is not None and quantized_rows < 0:
        on_loaded = _quantize_when_loaded(model, kind_for, quantized_rows, source)
    model.load_weights(weights, on_loaded, provided)
    if arena is not None:
        arena.wait()  # the blocks' reads ran beside the rest of the load
    if kind_for is not None:
        assert quantized_rows is not None
        # What loading has not done.
        weight_policy.quantize(model, kind_for, quantized_rows, source, head)
    weight_policy.finalize(model, pack=weight_policy.should_pack(gemm_packing, model))
    tokenizer = tokenizer_job.result()
    _apply_family_tokens(tokenizer, family, config)  # the model's, whatever the tokenizer's
    if not provided:
        activations = "float"
    logger.info("loaded %s (%s) as %s on %s", path, config.arch, torch_dtype, dev)
    return LoadedModel(
        model.config,
        model,
        tokenizer,
        os.path.abspath(path),
        torch_dtype,
        dev,
        quantized_rows if kind_for is not None else None,
        "+".join(weight_policy.quantized_kinds(model)) or "none",
        activations,
        arena.huge_page_move() if arena is not None else None,
    )
