"""The native decode step (all layers of a DECODE batch in one C call) computes what the
PyTorch path computes, for every weight format and the architectures' options."""

from __future__ import annotations

import pytest
import torch
from test_model_parity import PROMPT, decode, extend, make_hf_model, new_pool

from sglite.runtime.model import kernels
from sglite.runtime.model.kernels import native
from sglite.runtime.model.loader import load_model

pytestmark = pytest.mark.skipif(not kernels.native_available(), reason="no C compiler")


def _steps(loaded, prompts: list[list[int]], steps: int, native: bool) -> list[torch.Tensor]:
    """Logits of a batched prefill then `steps` batched decode steps (fixed tokens)."""
    loaded.model.use_native_decode = native
    pool = new_pool(loaded, 4096)
    try:
        logits, slots = extend(loaded, pool, prompts)
        out = [logits]
        for step in range(steps):
            tokens = [40 + step + i for i in range(len(prompts))]
            logits, slots = decode(loaded, pool, tokens, slots)
            out.append(logits)
        return out
    finally:
        loaded.model.use_native_decode = True


def _calls(loaded, monkeypatch) -> list[int]:
    """Records the row counts the native decoder served."""
    from sglite.runtime.model.native_decode import NativeDecoder

    served: list[int] = []
    real = NativeDecoder.run

    def spy(self, residual, batch, pool):
        done = real(self, residual, batch, pool)
        if done:
            served.append(residual.shape[0])
        return done

    monkeypatch.setattr(NativeDecoder, "run", spy)
    return served


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("llama", {}),
        ("qwen2", {}),  # q/k/v biases
        ("mistral", {"sliding_window": 5}),
        ("llama", {"num_attention_heads": 8, "num_key_value_heads": 1, "hidden_size": 128}),
    ],
)
def test_tiny_models_match_the_pytorch_path(tmp_path, monkeypatch, kind, overrides):
    make_hf_model(kind, str(tmp_path), **overrides)
    loaded = load_model(str(tmp_path), "float32", progress=False)
    served = _calls(loaded, monkeypatch)
    prompts = [PROMPT, PROMPT[:6], [1, 5, 9, 200, 201, 202, 203, 204, 205]]
    native = _steps(loaded, prompts, 6, native=True)
    assert served == [3] * 6  # every decode step went through the native call
    reference = _steps(loaded, prompts, 6, native=False)
    for a, b in zip(native, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "dtype, quantization, tol",
    [
        ("float32", "none", 2e-3),
        # bf16 rounds every activation: a GEMV summing in another order moves logits by ulps
        # (0.125 at 16), and the differences compound over 30 layers and 4 steps.
        ("bfloat16", "none", 1.0),
        ("bfloat16", "int4", 1e-3),  # the same quantized kernels on both paths
        ("float32", "int8", 1e-3),
        ("float32", "int4", 1e-3),
        ("float32", "w4a8", 1e-3),  # the C step's INT4_A8 rounds x as the Python path does
    ],
)
def test_default_model_matches_the_pytorch_path(monkeypatch, dtype, quantization, tol):
    loaded = load_model(None, dtype, progress=False, quantization=quantization)
    served = _calls(loaded, monkeypatch)
    tok = loaded.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("Seven times six is")]
    native = _steps(loaded, prompts, 4, native=True)
    assert served == [2] * 4
    reference = _steps(loaded, prompts, 4, native=False)
    for a, b in zip(native, reference, strict=True):
        assert (a - b).abs().max() < tol
        top2 = b.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * tol  # near ties may flip within the tolerance
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_float32_batches_of_any_size_run_natively_and_match(monkeypatch, tmp_path):
    """float32 weights in panels: the native step takes big batches too (the same GEMM as the
    PyTorch path, without its per-operation cost) and computes the same logits."""
    make_hf_model("qwen2", str(tmp_path))  # biases: added by the panel GEMM itself
    loaded = load_model(str(tmp_path), "float32", progress=False)
    served = _calls(loaded, monkeypatch)
    prompts = [[1, 2 + i, 3, 4 + i % 5] for i in range(40)]
    native = _steps(loaded, prompts, 2, native=True)
    assert served == [40, 40]
    reference = _steps(loaded, prompts, 2, native=False)
    for a, b in zip(native, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("quantization", ["int4", "int8", "q8_0", "w4a8"])
def test_quantized_float32_batches_of_any_size_run_natively_and_match(
    monkeypatch, tmp_path, quantization
):
    """Quantized float32 weights (no dense copy by default): past the GEMVs' 8 rows the native
    step runs the quantized GEMM, bias included, and computes the PyTorch path's logits."""
    make_hf_model("qwen2", str(tmp_path))
    loaded = load_model(str(tmp_path), "float32", progress=False, quantization=quantization)
    assert loaded.quantized_max_rows == -1
    served = _calls(loaded, monkeypatch)
    prompts = [[1, 2 + i, 3, 4 + i % 5] for i in range(20)]
    native = _steps(loaded, prompts, 2, native=True)
    assert served == [20, 20]
    reference = _steps(loaded, prompts, 2, native=False)
    for a, b in zip(native, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_int8_weights_the_quantized_gemm_cannot_take_fall_back_past_8_rows(monkeypatch, tmp_path):
    """48 inputs per projection are not whole vectors of 32: the native step keeps to the
    GEMVs' 8 rows and larger batches take the PyTorch path, which still computes them. (Heads
    of 16 so that every host's attention kernel takes them: see the next test.)"""
    make_hf_model(
        "llama", str(tmp_path), hidden_size=48, num_attention_heads=3, num_key_value_heads=1
    )
    loaded = load_model(str(tmp_path), "float32", progress=False, quantization="int8")
    served = _calls(loaded, monkeypatch)
    prompts = [[1, 2 + i, 3] for i in range(12)]
    native = _steps(loaded, prompts, 2, native=True)
    assert served == []  # not one native step of 12 rows, and no failed one either
    reference = _steps(loaded, prompts, 2, native=False)
    for a, b in zip(native, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    _steps(loaded, prompts[:3], 1, native=True)
    assert served == [3]  # small batches still run natively


@pytest.mark.parametrize("head_dim", [16, 24, 48])
def test_heads_the_attention_kernel_cannot_take_use_the_pytorch_path(
    monkeypatch, tmp_path, head_dim
):
    """The native step attends with whole vectors of the host's width (8 floats with AVX2, 16
    with AVX-512): a model whose head size is not a multiple of it has no native decoder and
    decodes through PyTorch, with the same logits. Released models' heads (64-256) fit both."""
    width = native.load().attention_vec_width()
    make_hf_model(
        "llama",
        str(tmp_path),
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    loaded = load_model(str(tmp_path), "float32", progress=False, quantization="int8")
    served = _calls(loaded, monkeypatch)
    prompts = [[1, 2 + i, 3] for i in range(3)]
    ours = _steps(loaded, prompts, 1, native=True)
    assert served == ([3] if head_dim % width == 0 else [])
    reference = _steps(loaded, prompts, 1, native=False)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_large_bf16_batches_use_the_pytorch_path(monkeypatch, tmp_path):
    make_hf_model("llama", str(tmp_path))
    loaded = load_model(str(tmp_path), "bfloat16", progress=False)
    served = _calls(loaded, monkeypatch)
    _steps(loaded, [[1, 2, 3], [1, 4, 3], [1, 5, 3]], 2, native=True)
    assert served == [3, 3]  # the native step serves this model's small batches...
    served.clear()
    prompts = [[1, 2 + i, 3] for i in range(12)]  # ...not more rows than its GEMV takes
    _steps(loaded, prompts, 2, native=True)
    assert served == []
