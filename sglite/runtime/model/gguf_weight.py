"""A GGUF file's quantized tensors held as the file stores them, and computed with from there.

`GGUFWeight` is a projection (or embedding, or output projection) whose rows are one or more
GGUF tensors in their own block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): the
parts of a fused projection (q/k/v, gate/up) may differ in type, as in Q4_K_M files where v is
Q6_K. The blocks are read-only views of the memory-mapped file (a copy only where rows must be
reordered), so the model holds each weight once, at the file's own bit width, and loading reads
nothing until the first forward touches it.

Kernels (`kernels/gguf_blocks.c`): the GEMV decodes 256 values of a weight row at a time into
cache and takes their dot products with a few x rows; float32 batches past it go through the
quantized GEMM (`quant_gemm`, rows decoded once per call), bfloat16 ones too up to
`BF16_QUANT_GEMM_MAX_ROWS` rows (in float32); larger bfloat16 batches decode the weight into a
scratch buffer the model owns (`DecodeScratch`, reused by every layer) and call PyTorch's GEMM.
On CPUs with AMX or AVX512-BF16, bfloat16 batches of `amx_min_rows` rows or more
(`AMX_MIN_ROWS` on AMX tiles, `BF16_DOT_MIN_ROWS` with AVX512-BF16 dot products; later for a
weight mostly of Q6_K blocks, whose decoding costs more) take `kernels/gguf_amx.c` instead: the
weight decoded to bfloat16 a block at a time into cache and multiplied there (no scratch, no
oneDNN reorder of it per call). Those products keep the activations as they are. Where bf16
products are slower than float32 ones (`kernels.bf16_matmul_pays`: no AMX, and AVX512-BF16 dot
products measured too slow, `kernels/bf16_probe.c`) no weight takes it, and the scratch GEMM
of a large bfloat16 batch runs in float32.

With `round_activations` (the loader's choice where the CPU has integer dot products: see
`load_options.resolve_gguf_activations`), DECODE batches (the decode step's `LINEAR_GGUF_A8` and
`matmul_decode`, the output projection's) instead round each x row to int8 as llama.cpp does
(`kernels/gguf_a8.c`: integer dot products over the blocks' own integers; from
`a8_gemm_min_rows` rows (all block types but Q5_K) `kernels/gguf_a8_gemm.c`, the same product with
512-bit VNNI, each block decoded once for all rows), as `w4a8` does in its decode GEMVs. Where
that VNNI GEMM serves a weight it is faster than the float GEMMs at any row count short of the
tile GEMM's (and than AVX512-BF16 dot products at every count: without AMX, such a weight takes
no tile GEMM, `_vnni_before_dot_products`), so bfloat16 prefill and other EXTEND passes
(`matmul`) round x there too, through the same kernels: a token's product is then the same
rounded one (to float rounding) in prefill and decode, alone or batched. So do float32 ones
where float32 is `dtype=auto`'s choice on a CPU without bf16 (`round_float32_extend`: there the
VNNI GEMM is 3.3-3.9x the float GEMM at prefill sizes). Elsewhere (an explicit float32, an AVX2
build, a weight of other block types) EXTEND passes keep x for the float GEMMs.
`matmul_rows` (deterministic inference) takes the int8 GEMV for every row count: its rows are
independent, so a token's values then do not depend on its batch, on prefill or decode, or on
the thread count.

Q5_0, Q8_0, Q4_K and Q6_K parts may be tiled (`GGUFPart.tiled`, `kernels/gguf_tiles.h`: the same
bytes, 16 rows interleaved in the VNNI GEMM's lane order; the loader's choice,
`gguf_block_weights`): such a weight has that GEMM, on x rounded to int8, as its one kernel for
every product and row count (no other product kernel reads a tiled part), so a row's values
never depend on its batch; its row lookups (`gguf_dequantize`) untile each row. On AVX2 builds
without VNNI, Q5_0 parts of projections may instead be held in quads (`GGUFPart.quads`,
`kernels/gguf_quads.h`: the same bytes, each row's blocks four at a time), which the int8 GEMV
decodes in about half the vector operations; every other kernel reads such a row back in the
file's layout, so the weight keeps its kernels and its float products' values.

Invariant: `matmul(x)` computes `x @ W.T` for `W` the weight gguf's own dequantization gives;
rounding, `matmul_decode`, `matmul_rows` and a bf16 `matmul` where `_rounds_extend` compute it
with x as gguf_a8.c rounds it.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
import torch.nn.functional as F

from sglite.runtime.model import kernels
from sglite.runtime.model.gguf_layouts import QUAD_VALUES, TILE_ROWS, unquad_q5_0, untile
from sglite.runtime.model.gguf_part import BLOCK_TYPES, GGUFPart, kind_name, row_bytes, type_id
from sglite.runtime.model.kernels.abi import ABI
from sglite.runtime.model.linear_weight import NATIVE_MAX_ROWS, QGEMV_MAX_ROWS, c_linear
from sglite.runtime.model.quantized_weight import QuantizedWeight

GGUF_MAX_PARTS = ABI.constants["GGUF_MAX_PARTS"]
GGUF_FLOAT_GEMV_MAX_ROWS = ABI.constants["GGUF_FLOAT_GEMV_MAX_ROWS"]
KERNEL_OFF_ROWS = ABI.constants["KERNEL_OFF_ROWS"]
A8_ROWS = ABI.constants["A8_ROWS"]
_PART = ABI.structs["gguf_part_t"]
# bfloat16 rows up to which products run in float32 through the quantized GEMM; larger batches
# (prefill) decode the weight into the scratch for PyTorch's bf16 GEMM (AMX where present).
BF16_QUANT_GEMM_MAX_ROWS = 16
# Bytes of a weight decoded to float32 at a time where bf16 batches multiply in float32
# (`GGUFWeight._float32_scratch_matmul`): an output head's 0.9 GB would double the scratch.
FLOAT32_SCRATCH_BYTES = 256 << 20


class DecodeScratch:
    """One growing buffer into which bfloat16 GEMMs decode their weight (the largest weight's
    size, held once per model instead of a dense copy of every weight). Single-threaded use."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A `[rows, cols]` tensor of `dtype` over the buffer (valid until the next call)."""
        need = rows * cols
        if self._buffer is None or self._buffer.dtype != dtype or self._buffer.numel() < need:
            self._buffer = torch.empty(need, dtype=dtype)
        return self._buffer[:need].view(rows, cols)


class GGUFWeight(QuantizedWeight):
    """A weight `[N, K]` as GGUF blocks (see the module docstring)."""

    def __init__(
        self,
        parts: list[GGUFPart],
        in_features: int,
        scratch: DecodeScratch | None = None,
        round_activations: bool = False,
        round_float32_extend: bool = False,
    ) -> None:
        if not 1 <= len(parts) <= GGUF_MAX_PARTS:
            raise ValueError(f"a GGUF weight has 1-{GGUF_MAX_PARTS} parts, not {len(parts)}")
        for part in parts:
            if part.type_name not in BLOCK_TYPES:
                raise ValueError(f"GGUF block type {part.type_name} is not supported")
            if part.quads and (part.type_name != "Q5_0" or in_features % QUAD_VALUES):
                raise ValueError(
                    f"only Q5_0 parts of rows of a multiple of {QUAD_VALUES} values are held "
                    f"in quads, not {part.type_name} of {in_features}"
                )
            expected = row_bytes(part.type_name, in_features)
            if part.data.dtype != np.uint8 or part.data.shape[1:] != (expected,):
                raise ValueError(
                    f"{part.type_name} part of shape {part.data.shape} is not rows of "
                    f"{expected} bytes ({in_features} values)"
                )
        self.parts = parts
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)
        self.scratch = scratch or DecodeScratch()
        self.round_activations = round_activations
        self.round_float32_extend = round_float32_extend
        self.tiled = any(p.tiled for p in parts)
        self.kind = "+".join(sorted({kind_name(p) for p in parts}))
        self._table = (_PART * len(parts))(
            *(_PART(type_id(p), p.rows, p.data.ctypes.data) for p in parts)
        )
        self.address = ctypes.addressof(self._table)
        self.amx_min_rows = kernels.gguf_amx_min_rows(
            self.address, self.out_features, self.in_features
        )
        self.a8_gemm_min_rows = kernels.gguf_a8_gemm_min_rows(
            self.address, self.out_features, self.in_features
        )
        if self._vnni_before_dot_products():
            self.amx_min_rows = KERNEL_OFF_ROWS
        if self.tiled:
            self._check_tiled()

    def _check_tiled(self) -> None:
        """A weight with tiled parts has one kernel, the VNNI GEMM rounding x, for every
        product: ValueError where it cannot take them all."""
        if not self.round_activations or self.a8_gemm_min_rows != 1:
            raise ValueError(
                "tiled parts need activations rounded to int8 and the VNNI GEMM "
                "(a VNNI-512 build, parts of whole 16-row tiles)"
            )
        self.amx_min_rows = KERNEL_OFF_ROWS

    def _vnni_before_dot_products(self) -> bool:
        """Whether the VNNI GEMM takes the bf16 batches the tile GEMM would: rounding
        activations, on a CPU without AMX, where that GEMM serves the weight. An int8
        `vpdpbusd` does twice the multiplies of a bf16 `vdpbf16ps` of the same width, and int8
        decoding is the cheaper, so it is the faster product at every row count (prefill's
        included) wherever the tiles are not AMX's."""
        return (
            self.round_activations
            and self.a8_gemm_min_rows < KERNEL_OFF_ROWS
            and self.amx_min_rows < KERNEL_OFF_ROWS
            and not kernels.amx_available()
        )

    def regroups_decode_rows(self) -> bool:
        """Whether a DECODE batch of more than `A8_ROWS` rows takes the int8 GEMV, which
        decodes every weight block once per group of `A8_ROWS` x rows (no GEMM takes it
        there): its product of `A8_ROWS + 1` rows costs about twice that of `A8_ROWS`."""
        rows = A8_ROWS + 1
        return (
            self.round_activations
            and not self.tiled
            and self.a8_gemm_min_rows > rows
            and self.amx_min_rows > rows
        )

    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def nbytes(self) -> int:
        """The blocks' bytes: the file's own size of these tensors."""
        return sum(p.data.nbytes for p in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T`: bfloat16 batches of `amx_min_rows` rows or more through `gguf_gemm_amx`
        where it runs (AMX tiles or AVX512-BF16); else, rounding activations where the VNNI GEMM
        serves the weight (`_rounds_extend`), x rounded as in a DECODE batch; else x as it is:
        the GEMV for a few rows,
        the quantized GEMM for float32 batches and bfloat16 ones up to BF16_QUANT_GEMM_MAX_ROWS
        rows (in float32), and larger ones through the scratch and PyTorch's GEMM (in float32
        where bf16 products do not pay here)."""
        if self.tiled:
            return self._tiled_matmul(x)
        rows = x.shape[0]
        gemv_rows = GGUF_FLOAT_GEMV_MAX_ROWS if x.dtype == torch.float32 else QGEMV_MAX_ROWS
        out = None
        if self._tile_rows(x):
            out = kernels.gguf_gemm_amx(x.contiguous(), self.address, self.out_features)
        elif self._rounds_extend(x):
            out = self._rounded_matmul(x)
        if out is None and rows <= gemv_rows:
            out = kernels.gguf_gemv(x.contiguous(), self.address, self.out_features)
        if out is None and (x.dtype == torch.float32 or rows <= BF16_QUANT_GEMM_MAX_ROWS):
            # bf16 decode batches: float32 rows through the quantized GEMM (decoding the whole
            # weight for a few dozen rows would cost more than their products).
            out = kernels.gguf_gemm(x.float(), self.address, self.out_features)
            out = None if out is None else out.to(x.dtype)
        if out is not None:
            return out
        if x.dtype == torch.bfloat16 and not kernels.bf16_matmul_pays():
            return self._float32_scratch_matmul(x)
        return F.linear(x, self.decoded(x.dtype, self.scratch))

    def _tiled_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """A tiled weight's product, any rows: the VNNI GEMM on x rounded to int8 (each row's
        result depends on that row alone)."""
        out = kernels.gguf_gemm_a8(x.contiguous(), self.address, self.out_features)
        if out is None:
            raise RuntimeError(f"the VNNI GEMM refused a tiled weight's {tuple(x.shape)} batch")
        return out

    def _float32_scratch_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 `x @ W.T` through float32 GEMMs, for CPUs whose bf16 products are slower than
        float32 ones (`kernels.bf16_matmul_pays`): x widened, the weight decoded to float32 into
        the scratch at most `FLOAT32_SCRATCH_BYTES` at a time (a slice of rows), the result
        rounded to bf16 once."""
        n, k = self.shape()
        wide = x.float()
        step = max(1, FLOAT32_SCRATCH_BYTES // (4 * k))
        if step >= n or not kernels.native_available():
            return F.linear(wide, self.decoded(torch.float32, self.scratch)).to(x.dtype)
        out = x.new_empty(x.shape[0], n)
        for start in range(0, n, step):
            ids = torch.arange(start, min(n, start + step))
            into = self.scratch.take(len(ids), k, torch.float32)
            part = kernels.gguf_dequantize(self.address, n, k, torch.float32, ids, out=into)
            assert part is not None  # ids in range, native library present
            out[:, start : start + len(ids)] = F.linear(wide, part)
        return out

    def matmul_decode(self, x: torch.Tensor) -> torch.Tensor:
        """A DECODE batch's product: rounding activations, the int8 kernels (`_rounded_matmul`)
        below `amx_min_rows` rows, where `matmul` takes `gguf_gemm_amx`, faster from there;
        else `matmul`."""
        if self.tiled:
            return self._tiled_matmul(x)
        if self.round_activations and not self._tile_rows(x):
            out = self._rounded_matmul(x)
            if out is not None:
                return out
        return self.matmul(x)

    def _rounded_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """x rounded to int8: from `a8_gemm_min_rows` rows the VNNI GEMM, else the GEMV."""
        out = None
        if x.shape[0] >= self.a8_gemm_min_rows:
            out = kernels.gguf_gemm_a8(x.contiguous(), self.address, self.out_features)
        if out is None:
            out = kernels.gguf_gemv_a8(x.contiguous(), self.address, self.out_features)
        return out

    def _rounds_extend(self, x: torch.Tensor) -> bool:
        """Whether an EXTEND pass's product (`matmul`) rounds x as a DECODE batch's does:
        rounding activations, of a weight the VNNI GEMM serves (faster than the float GEMMs
        there at any row count), a bfloat16 batch, or a float32 one with
        `round_float32_extend` (float32 as `dtype=auto`'s choice on a CPU without bf16, not
        asked for: an explicit float32 keeps its exact products)."""
        return (
            self.round_activations
            and (x.dtype == torch.bfloat16 or self.round_float32_extend)
            and self.a8_gemm_min_rows < KERNEL_OFF_ROWS
        )

    def matmul_gated(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """The gated product without the `[rows, out_features]` intermediate, through the
        GEMM `matmul` takes for x: the tile GEMM (`kernels.gguf_gemm_amx_glu`), or the VNNI GEMM
        on rounded activations from `a8_gemm_min_rows` rows (`kernels.gguf_gemm_a8_glu`); else
        None. Equal bit for bit to that GEMM followed by `gated_act`."""
        code = kernels.ACTIVATION_CODES[act]
        if self.tiled:
            return kernels.gguf_gemm_a8_glu(x.contiguous(), self.address, self.out_features, code)
        if self._tile_rows(x):
            return kernels.gguf_gemm_amx_glu(x.contiguous(), self.address, self.out_features, code)
        if self._rounds_extend(x) and x.shape[0] >= self.a8_gemm_min_rows:
            return kernels.gguf_gemm_a8_glu(x.contiguous(), self.address, self.out_features, code)
        return None

    def _tile_rows(self, x: torch.Tensor) -> bool:
        """Whether `matmul` takes `gguf_gemm_amx` for x (bfloat16, `amx_min_rows` rows or more,
        on AMX tiles or AVX512-BF16 dot products)."""
        return (
            x.dtype == torch.bfloat16
            and x.shape[0] >= self.amx_min_rows
            and kernels.tile_gemm_available()
        )

    def matmul_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """float32: the GEMM (rows independent) for every row count; bf16: the GEMV in chunks
        of its rows; rounding activations, the int8 kernel (rows independent): a tiled weight's
        GEMM."""
        if self.tiled:
            return self._tiled_matmul(x)
        if self.round_activations:
            return kernels.gguf_gemv_a8(
                x.contiguous(), self.address, self.out_features, row_independent=True
            )
        if x.dtype == torch.float32:
            return kernels.gguf_gemm(x, self.address, self.out_features, row_independent=True)
        n, step = self.out_features, QGEMV_MAX_ROWS
        chunks = [
            kernels.gguf_gemv(x[i : i + step].contiguous(), self.address, n)
            for i in range(0, x.shape[0], step)
        ]
        if not chunks or any(c is None for c in chunks):
            return None
        return torch.cat(chunks)  # type: ignore[arg-type]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight, dense in `dtype` (an embedding lookup). Raises IndexError
        for ids outside the weight."""
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"token ids must be in [0, {self.out_features})")
        out = kernels.gguf_dequantize(
            self.address, self.out_features, self.in_features, dtype, flat.cpu()
        )
        if out is None:
            out = self._decoded_numpy(flat.cpu().numpy()).to(dtype)
        return out.view(*ids.shape, self.in_features)

    def decoded(self, dtype: torch.dtype, scratch: DecodeScratch | None = None) -> torch.Tensor:
        """The whole weight dense in `dtype` (into `scratch` when given: valid until its next
        use)."""
        out = None if scratch is None else scratch.take(*self.shape(), dtype)
        decoded = kernels.gguf_dequantize(
            self.address, self.out_features, self.in_features, dtype, out=out
        )
        if decoded is None:
            decoded = self._decoded_numpy(np.arange(self.out_features)).to(dtype)
        return decoded

    def _decoded_numpy(self, ids: np.ndarray) -> torch.Tensor:
        """gguf's own (numpy) dequantization of rows `ids`: the path without native kernels."""
        import gguf

        starts = np.cumsum([0] + [p.rows for p in self.parts])
        out = np.empty((len(ids), self.in_features), dtype=np.float32)
        for i, row in enumerate(ids):
            j = int(np.searchsorted(starts, row, side="right")) - 1
            part = self.parts[j]
            kind = gguf.GGMLQuantizationType[part.type_name]
            block_row = part.data[row - starts[j]]
            if part.quads:
                block_row = unquad_q5_0(part.data[row - starts[j]][None])[0]
            if part.tiled:
                tile = (row - starts[j]) // TILE_ROWS
                rows = untile(part.type_name, part.data[tile * TILE_ROWS : (tile + 1) * TILE_ROWS])
                block_row = rows[(row - starts[j]) % TILE_ROWS]
            out[i] = gguf.quants.dequantize(block_row, kind).reshape(-1)
        return torch.from_numpy(out)

    def native_linear(self, bias: torch.Tensor | None) -> ctypes.Structure | None:
        n, k = self.shape()
        kind = "GGUF_A8" if self.round_activations else "GGUF"
        return c_linear(
            kind, n, k, self.address, None, bias, self.amx_min_rows, self.a8_gemm_min_rows
        )

    def native_rows(self, dtype: torch.dtype) -> int:
        """Any batch in float32 (the C step runs the quantized GEMM past the GEMV's rows),
        rounding activations, or in bfloat16 where `gguf_gemm_amx` runs (the C step takes it
        from `amx_min_rows` rows); else the GEMV's rows."""
        if self.round_activations or dtype == torch.float32 or kernels.bf16_matmul_pays():
            return NATIVE_MAX_ROWS
        return QGEMV_MAX_ROWS
