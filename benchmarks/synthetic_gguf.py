"""A synthetic GGUF with a real model's shapes and tokenizer and random quantized weights.

`bench_footprint --synthetic-7b` serves it to measure resident memory and start time of a 7B
model without downloading one. The file has Qwen2.5-7B-Instruct's shapes (architecture `qwen2`),
a Q4_K_M-like mix (Q4_K for token_embd, attn_q/k/output, ffn_gate/up; Q6_K for attn_v,
ffn_down, output; F32 norms and q/k/v biases) and the tokenizer metadata of a real Qwen2.5 GGUF.

- Quantized blocks are random bytes except their f16 super-block scales (Q4_K `d`, `dmin`;
  Q6_K `d`), which are small finite positive values chosen so that weights are of the order of
  a trained model's (|w| ~ 0.02-0.1), never NaN/Inf. The text generated is gibberish.
- Qwen2.5-7B's embedding has 152064 rows while its tokenizer has fewer tokens; llama.cpp takes
  the vocabulary size from the token list and wants the embedding to match it exactly, so the
  token list is padded with `[PAD{i}]` tokens of type UNUSED, as llama.cpp's convert_hf_to_gguf
  does for the real model.
- Tensor data is streamed: each tensor is generated chunk by chunk while it is written, so the
  writer never holds more than one chunk (~16 MB) of it.

    python -m benchmarks.synthetic_gguf --out /tmp/qwen2.5-7b-synthetic.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
# Where the tokenizer metadata is copied from by default: a known Qwen2.5 model (the same
# tokenizer family), `sglite models pull qwen2.5-coder-0.5b`.
DEFAULT_TOKENIZER_MODEL = "qwen2.5-coder-0.5b"
CHUNK_BYTES = 16 << 20
# Super-block scales (f16) of the random blocks; see the module docstring. Q4_K's dmin is 7.5 d
# so that a block's mean weight, d*scale*q - dmin*min with q ~ 7.5 on average, is about zero.
Q4_K_D = 1e-4
Q4_K_DMIN = 7.5e-4
Q6_K_D = 1e-4


@dataclass(frozen=True)
class SyntheticConfig:
    """The hyper-parameters of a `qwen2` model."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_rows: int
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    context: int = 32768
    name: str = "synthetic"


QWEN25_7B = SyntheticConfig(
    layers=28,
    hidden=3584,
    intermediate=18944,
    heads=28,
    kv_heads=4,
    head_dim=128,
    vocab_rows=152064,
    name="Qwen2.5-7B-Instruct shapes (synthetic random weights)",
)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: numpy-order shape (rows, columns) and its GGML type."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        *outer, cols = self.shape
        return int(np.prod(outer, dtype=np.int64)) * cols // block * size


def tensor_plan(cfg: SyntheticConfig) -> list[TensorSpec]:
    """Every tensor of the model, in the order llama.cpp's converter writes them."""
    h, kv = cfg.hidden, cfg.kv_heads * cfg.head_dim
    q_dim, ff = cfg.heads * cfg.head_dim, cfg.intermediate
    plan = [TensorSpec("token_embd.weight", (cfg.vocab_rows, h), QT.Q4_K)]
    for i in range(cfg.layers):
        b = f"blk.{i}."
        plan += [
            TensorSpec(b + "attn_norm.weight", (h,), QT.F32),
            TensorSpec(b + "attn_q.weight", (q_dim, h), QT.Q4_K),
            TensorSpec(b + "attn_q.bias", (q_dim,), QT.F32),
            TensorSpec(b + "attn_k.weight", (kv, h), QT.Q4_K),
            TensorSpec(b + "attn_k.bias", (kv,), QT.F32),
            TensorSpec(b + "attn_v.weight", (kv, h), QT.Q6_K),
            TensorSpec(b + "attn_v.bias", (kv,), QT.F32),
            TensorSpec(b + "attn_output.weight", (h, q_dim), QT.Q4_K),
            TensorSpec(b + "ffn_norm.weight", (h,), QT.F32),
            TensorSpec(b + "ffn_gate.weight", (ff, h), QT.Q4_K),
            TensorSpec(b + "ffn_up.weight", (ff, h), QT.Q4_K),
            TensorSpec(b + "ffn_down.weight", (h, ff), QT.Q6_K),
        ]
    plan += [
        TensorSpec("output_norm.weight", (h,), QT.F32),
        TensorSpec("output.weight", (cfg.vocab_rows, h), QT.Q6_K),
    ]
    return plan


def _f16_bytes(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    """`n` f16 values in [0.5, 1.5) x `scale`, as (n, 2) bytes."""
    values = (scale * rng.uniform(0.5, 1.5, n)).astype(np.float16)
    return values.view(np.uint8).reshape(n, 2)


def random_blocks(rng: np.random.Generator, qtype: gguf.GGMLQuantizationType, n: int) -> np.ndarray:
    """`n` random Q4_K or Q6_K blocks as (n, block bytes) uint8, with sane f16 scales."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = np.frombuffer(rng.bytes(n * size), np.uint8).reshape(n, size).copy()
    if qtype == QT.Q4_K:  # d, dmin, scales[12], qs[128]
        blocks[:, 0:2] = _f16_bytes(rng, n, Q4_K_D)
        blocks[:, 2:4] = _f16_bytes(rng, n, Q4_K_DMIN)
    elif qtype == QT.Q6_K:  # ql[128], qh[64], scales[16], d
        blocks[:, size - 2 :] = _f16_bytes(rng, n, Q6_K_D)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return blocks


def f32_values(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """Norm weights are ones; biases small random values."""
    if spec.name.endswith(".bias"):
        return rng.normal(0.0, 0.02, spec.shape).astype(np.float32)
    return np.ones(spec.shape, np.float32)


class StreamedTensor:
    """What `GGUFWriter.write_tensor_data` needs of an array (`nbytes`, `tofile`), generated
    chunk by chunk as it is written instead of held whole."""

    def __init__(self, spec: TensorSpec, rng: np.random.Generator) -> None:
        self.spec = spec
        self.rng = rng
        self.nbytes = spec.nbytes

    def tofile(self, fp: IO[bytes]) -> None:
        """Write the tensor's bytes to `fp`."""
        if self.spec.qtype == QT.F32:
            f32_values(self.spec, self.rng).tofile(fp)
            return
        size = gguf.GGML_QUANT_SIZES[self.spec.qtype][1]
        left = self.nbytes // size
        per_chunk = max(1, CHUNK_BYTES // size)
        while left:
            n = min(left, per_chunk)
            random_blocks(self.rng, self.spec.qtype, n).tofile(fp)
            left -= n


def tokenizer_fields(source: str | os.PathLike[str]) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, type, array item type) of every `tokenizer.*` item of a GGUF file."""
    reader = gguf.GGUFReader(source)
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub))
    return out


def pad_vocabulary(fields: list[tuple[str, Any, Any, Any]], rows: int) -> int:
    """Pad the token list (and per-token arrays) in place to `rows` tokens; returns the count
    added. Raises if the tokenizer already has more tokens than the embedding has rows."""
    by_key = {f[0]: f for f in fields}
    tokens = by_key["tokenizer.ggml.tokens"][1]
    have = len(tokens)
    if have > rows:
        raise ValueError(f"the tokenizer has {have} tokens, more than the {rows} embedding rows")
    tokens.extend(f"[PAD{i}]" for i in range(have, rows))
    if "tokenizer.ggml.token_type" in by_key:
        by_key["tokenizer.ggml.token_type"][1].extend([int(gguf.TokenType.UNUSED)] * (rows - have))
    if "tokenizer.ggml.scores" in by_key:
        by_key["tokenizer.ggml.scores"][1].extend([-1000.0] * (rows - have))
    return rows - have


def _add_model_metadata(w: gguf.GGUFWriter, cfg: SyntheticConfig) -> None:
    w.add_type("model")
    w.add_name(cfg.name)
    w.add_block_count(cfg.layers)
    w.add_context_length(cfg.context)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.intermediate)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_synthetic(
    path: str | os.PathLike[str],
    cfg: SyntheticConfig,
    tokenizer_gguf: str | os.PathLike[str],
    seed: int = 0,
) -> Path:
    """Write the synthetic GGUF to `path` (through a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    rng = np.random.default_rng(seed)
    fields = tokenizer_fields(tokenizer_gguf)
    pad_vocabulary(fields, cfg.vocab_rows)
    w = gguf.GGUFWriter(tmp, "qwen2")
    try:
        _add_model_metadata(w, cfg)
        for key, value, vtype, sub in fields:
            w.add_key_value(key, value, vtype, sub_type=sub)
        plan = tensor_plan(cfg)
        for spec in plan:
            dtype = np.float32 if spec.qtype == QT.F32 else np.uint8
            shape = spec.shape
            if spec.qtype != QT.F32:
                shape = gguf.quant_shape_to_byte_shape(spec.shape, spec.qtype)
            w.add_tensor_info(spec.name, shape, np.dtype(dtype), spec.nbytes, raw_dtype=spec.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for spec in plan:
            w.write_tensor_data(StreamedTensor(spec, rng))  # type: ignore[arg-type]
        w.close()
        os.replace(tmp, path)
    finally:  # a failed write leaves no partial file behind
        w.close()
        if tmp.exists():
            tmp.unlink()
    return path


def default_synthetic_dir() -> Path:
    """`$SGLITE_CACHE_DIR/synthetic` (default `~/.cache/sglite/synthetic`)."""
    from sglite.runtime.model.gguf_index import sglite_cache_dir

    return sglite_cache_dir() / "synthetic"


def synthetic_7b(
    directory: str | os.PathLike[str] | None = None,
    tokenizer_gguf: str | os.PathLike[str] = DEFAULT_TOKENIZER_MODEL,
) -> Path:
    """The synthetic Qwen2.5-7B GGUF under `directory`, written on first use (~5 GB), its
    tokenizer copied from `tokenizer_gguf` (a path or a known model name)."""
    from sglite.runtime.model.catalog import resolve_model_path

    path = synthetic_7b_path(directory)
    if not path.is_file():
        source = resolve_model_path(str(tokenizer_gguf))
        print(f"writing {path} (~{total_bytes(QWEN25_7B) / 1e9:.1f} GB) ...", flush=True)
        write_synthetic(path, QWEN25_7B, source)
    return path


def total_bytes(cfg: SyntheticConfig) -> int:
    """Tensor bytes of the model (without metadata and padding)."""
    return sum(spec.nbytes for spec in tensor_plan(cfg))


def main(argv: list[str] | None = None) -> int:
    """Command line: write the synthetic 7B GGUF."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.synthetic_gguf", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", help="file to write (default: the cached path bench_footprint uses)")
    ap.add_argument(
        "--tokenizer-gguf",
        default=DEFAULT_TOKENIZER_MODEL,
        help="a Qwen2.5 GGUF (path or known model name) whose tokenizer metadata is copied",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rewrite an existing file")
    args = ap.parse_args(argv)
    from sglite.runtime.model.catalog import resolve_model_path

    try:
        source = resolve_model_path(args.tokenizer_gguf)
    except FileNotFoundError as exc:
        print(f"--tokenizer-gguf: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else synthetic_7b_path()
    if out.exists() and not args.force:
        print(f"{out} exists (--force to rewrite)")
        return 0
    write_synthetic(out, QWEN25_7B, source, args.seed)
    print(f"{out}: {out.stat().st_size / 1e9:.2f} GB")
    return 0


def synthetic_7b_path(directory: str | os.PathLike[str] | None = None) -> Path:
    """Where `synthetic_7b` keeps the file."""
    return Path(directory or default_synthetic_dir()) / "qwen2.5-7b-synthetic-q4_k_m.gguf"


if __name__ == "__main__":
    sys.exit(main())
