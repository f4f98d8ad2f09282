"""What a model load's options resolve to on this host and device: the dtype ("auto": bfloat16
where the CPU computes it natively), the weight quantization ("auto": a GGUF's own blocks where
the native kernels run), and how GGUF blocks take their activations ("auto": int8 where the
kernels have an integer dot product); and the checks that refuse a combination that cannot
run. `loader.load_model` asks them once per load."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglite.runtime.model.cpu_features import cpu_flags
from sglite.runtime.model.quantization import QUANTIZATIONS

if TYPE_CHECKING:
    from sglite.runtime.model.gguf_index import GGUFFile

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX), read from /proc/cpuinfo."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """Map a dtype name to torch; "auto" is bfloat16 where the hardware has it, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.lower().removeprefix("torch.")
    if name == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def resolve_quantization(
    kind: str, gguf_file: GGUFFile | None, dtype: torch.dtype, device: torch.device
) -> str:
    """`kind` as given, or for "auto" the file's own: a GGUF whose projections are quantized
    runs each quantized as its tensors are (`gguf_auto_quantization.auto_quantization`: int4,
    int8 or both, joined by "+") on a CPU with the native kernels, in float32 or bfloat16;
    anything else (safetensors, float GGUFs, CUDA) runs dense."""
    from sglite.runtime.model import kernels
    from sglite.runtime.model.gguf_auto_quantization import auto_quantization

    if kind != "auto":
        return kind
    if gguf_file is None or device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return "none"
    if not kernels.native_available():  # without them quantized weights run slower than dense
        return "none"
    return auto_quantization(gguf_file)


GGUF_ACTIVATIONS = ("auto", "int8", "float")


def resolve_gguf_activations(choice: str, isa: list[str] | None = None) -> str:
    """`choice` as given; "auto" is int8 where the kernels were built with an integer dot
    product (`isa`, default the loaded library's: AVX2 `vpmaddubsw`, which AVX-512 hosts have
    too), else float (the portable C path decodes each weight row to float for int8 anyway)."""
    from sglite.runtime.model.kernels import native

    if choice not in GGUF_ACTIVATIONS:
        raise ValueError(f"gguf_activations must be one of {GGUF_ACTIVATIONS}, got {choice!r}")
    if choice != "auto":
        return choice
    return "int8" if "avx2_fma" in (native.isa() if isa is None else isa) else "float"


def serves_gguf_blocks(resolved: str, device: torch.device) -> bool:
    """Whether a GGUF's quantized tensors are held as its own blocks (`GGUFWeight`): with
    `--quantization auto` resolved to a quantized format (the native kernels, on the CPU)."""
    return resolved != "none" and device.type == "cpu"


def check_quantization(kind: str, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ValueError naming the problem where quantization `kind` cannot run here."""
    if kind not in QUANTIZATIONS:
        choices = ", ".join(("auto", *QUANTIZATIONS))
        raise ValueError(f"unknown quantization {kind!r}; use one of {choices}")
    if kind == "none":
        return
    if device.type != "cpu":
        raise ValueError(f"quantization {kind} uses PyTorch's CPU kernels; it needs device=cpu")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantization {kind} needs dtype float32 or bfloat16, not {dtype}")
