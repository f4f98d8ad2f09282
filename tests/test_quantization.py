"""Weight-only int8 / int4 quantization: exact GGUF 4-bit loading, dispatch by batch size, and
end-to-end agreement with the dense model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode
from sglite.runtime.model.gguf_quants import int4_parts_from_gguf
from sglite.runtime.model.gguf_weight import GGUFWeight
from sglite.runtime.model.linear import Linear
from sglite.runtime.model.linear_weight import PlainWeight
from sglite.runtime.model.loader import load_model
from sglite.runtime.model.quantization import quantize_int4
from sglite.runtime.model.quantized_weight import Int4Weight, Int8Weight, Q8Weight


@pytest.fixture(scope="module")
def dense32():
    return load_model(None, "float32", progress=False)


@pytest.fixture(scope="module")
def int4_32():
    return load_model(None, "float32", progress=False, quantization="int4", quantized_max_rows=4)


def test_int4_quantize_error_is_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    parts = quantize_int4(w, 32)
    step = parts.scale.repeat_interleave(32, dim=1)
    # Half a step, plus the float16 rounding of the group's offset.
    assert ((parts.dequantize() - w).abs() <= step / 2 + 1e-3).all()
    x = torch.randn(3, 128)
    ref = x @ parts.dequantize().t()
    # The native kernel rounds x to int8 per group of 32 (as llama.cpp does).
    assert (Int4Weight(parts, torch.float32).matmul(x) - ref).norm() / ref.norm() < 1e-2


def test_int8_matmul_matches_its_dequantized_weight():
    torch.manual_seed(1)
    w = torch.randn(96, 64)
    q = Int8Weight(w, torch.float32)
    dequant = q.values.float() * q.scale[:, None]
    for rows in (5, 37):  # 37: more rows than one native GEMV call takes (chunked)
        x = torch.randn(rows, 64)
        torch.testing.assert_close(q.matmul(x), x @ dequant.t(), atol=1e-4, rtol=0)
    assert (dequant - w).abs().max() <= w.abs().max() / 127


def test_gguf_q4_blocks_decode_like_ggml():
    import gguf
    import numpy as np

    from sglite.runtime.model.loader import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    tensor = next(t for t in reader.tensors if t.tensor_type.name == "Q4_1")
    shape = tuple(int(d) for d in reversed(tensor.shape))
    ours = int4_parts_from_gguf(tensor.data, "Q4_1", shape).dequantize()
    ref = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    torch.testing.assert_close(ours, torch.from_numpy(np.asarray(ref, dtype=np.float32)))


def test_int4_from_gguf_is_exactly_the_file(dense32, int4_32):
    """The default model's projections are Q4_1: int4 takes those values, nothing is lost."""
    from sglite.runtime.model import kernels

    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj", "self_attn.o_proj"):
        dense = dense32.model.get_submodule(f"layers.3.{name}")
        quant = int4_32.model.get_submodule(f"layers.3.{name}")
        q = quant.quantized
        assert isinstance(q, Int4Weight) and q.native
        weight = kernels.int4_dequantize(q.packed, q.scale_offset, torch.float32)
        torch.testing.assert_close(weight, dense.weight, atol=1e-6, rtol=0)
        x = torch.randn(2, dense.in_features)
        ref = F.linear(x, dense.weight)
        assert (quant(x) - ref).norm() / ref.norm() < 1e-2


def test_linear_dispatches_by_rows(int4_32):
    layer = int4_32.model.get_submodule("layers.0.mlp.down_proj")
    assert isinstance(layer, Linear) and layer.quantized_max_rows == 4
    calls = []
    real = layer.quantized.matmul
    layer.quantized.matmul = lambda x: calls.append(x.shape[0]) or real(x)
    try:
        layer(torch.randn(4, layer.in_features))
        layer(torch.randn(5, layer.in_features))
    finally:
        layer.quantized.matmul = real
    assert calls == [4]  # 5 rows went to the dense weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_layouts_compute_the_same_product_at_every_row_count(dtype):
    """float32 keeps one extra layout (panels for the native GEMM, serving every row count), bf16
    two (packed for oneDNN up to PACKED_MAX_ROWS rows, transposed beyond); each gives
    x @ W.T + b. bf16 runs here even where oneDNN cannot pack it (then only the transposed copy
    exists)."""
    from sglite.runtime.model import kernels
    from sglite.runtime.model.linear_weight import (
        PACKED_MAX_ROWS,
        BlockedWeight,
        PanelWeight,
        pack_for_onednn,
    )

    torch.manual_seed(0)
    layer = Linear(96, 80, bias=True).to(dtype)
    layer.finalize(extra_layouts=True)
    if dtype == torch.float32 and kernels.native_available():
        assert isinstance(layer.kernel, PanelWeight)
    else:
        kernel = layer.kernel
        assert isinstance(kernel, BlockedWeight)
        packable = pack_for_onednn(layer.weight.data) is not None  # bf16 needs CPU support
        assert (kernel.packed is not None) == packable
        # Without a packed copy the transposed one serves large batches, in any dtype.
        assert (kernel.weight_t is None) == (packable and dtype == torch.float32)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for rows in (1, 2, 8, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 1000):
        x = torch.randn(rows, 96).to(dtype)
        want = (x.float() @ layer.weight.float().T + layer.bias.float()).to(dtype)
        got = layer(x)
        assert got.shape == (rows, 80) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    layer.finalize(extra_layouts=False)
    assert isinstance(layer.kernel, PlainWeight)


def _logits(loaded, prompt: list[int], forced: list[int]) -> list[torch.Tensor]:
    """Prefill, then one decode step per token of `forced`; the logits of each pass."""
    cfg = loaded.config
    pool = KVPool(256, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype)
    slots = pool.alloc(len(prompt))
    batch = ForwardBatch.build(ForwardMode.EXTEND, [prompt], [0], [slots], [len(prompt) - 1])
    out = [loaded.model(batch, pool)[0]]
    for tok in forced:
        slots = slots + pool.alloc(1)
        batch = ForwardBatch.build(ForwardMode.DECODE, [[tok]], [len(slots) - 1], [slots], [0])
        out.append(loaded.model(batch, pool)[0])
    return out


def test_int4_model_computes_what_the_dense_model_computes(dense32, int4_32):
    """int4 on the default GGUF is lossless: its layers take the file's own Q4_1 values with
    activations kept in float32, and the output projection the file's own Q8_0 embedding, so
    the logits are the dense model's to float rounding and every greedy choice agrees."""
    from sglite.runtime.model.quantized_weight import Q8Weight

    assert isinstance(int4_32.model.lm_head_quantized, Q8Weight)
    tok = dense32.tokenizer
    prompt = tok.encode("Photosynthesis turns light, water and carbon dioxide into")
    forced = tok.encode(" sugar and oxygen. It happens in the leaves of green plants")
    ref = _logits(dense32, prompt, forced)
    ours = _logits(int4_32, prompt, forced)
    for a, b in zip(ref, ours, strict=True):
        assert (a - b).abs().max() < 1e-3
        assert int(a.argmax()) == int(b.argmax())


def test_w4a8_model_stays_close_to_the_dense_model(dense32):
    """w4a8 rounds activations to int8 in the decode GEMVs (as llama.cpp does): the logits move
    a little, which may flip near ties only."""
    w4a8 = load_model(None, "float32", progress=False, quantization="w4a8")
    tok = dense32.tokenizer
    prompt = tok.encode("Photosynthesis turns light, water and carbon dioxide into")
    forced = tok.encode(" sugar and oxygen. It happens in the leaves of green plants")
    for a, b in zip(_logits(dense32, prompt, forced), _logits(w4a8, prompt, forced), strict=True):
        assert 0 < (a - b).abs().max() < 1.5
        top2 = a.topk(2).values
        if top2[0] - top2[1] > 0.5:
            assert int(a.argmax()) == int(b.argmax())


def test_quantized_only_frees_dense_weights():
    loaded = load_model(
        None, "bfloat16", progress=False, quantization="int8", quantized_max_rows=-1
    )
    layer = loaded.model.get_submodule("layers.0.mlp.gate_up_proj")
    assert layer.weight.numel() == 0 and isinstance(layer.quantized, Int8Weight)
    prompt = loaded.tokenizer.encode("One, two, three,")
    logits = _logits(loaded, prompt, [11, 12])  # prefill of several rows also runs quantized
    assert all(torch.isfinite(x).all() for x in logits)


def test_bad_quantization_arguments():
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model(None, "float32", progress=False, quantization="int3")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        load_model(None, "float16", progress=False, quantization="int8")
    from sglite.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match="quantization"):
        ServerArgs.from_kwargs(quantization="fp8")
    with pytest.raises(ValueError, match="device='cpu'"):
        ServerArgs.from_kwargs(quantization="int4", device="cuda")


def test_float32_quantized_models_keep_no_dense_copy_and_compute_the_same():
    """By default a float32 model quantized to int4 keeps only its 4-bit weights (the native
    quantized GEMM serves every batch size) and computes what a dense copy of the same weights
    computes (the GGUF's Q4_1 values are the dense copy's too), for prefill-size and decode-size
    batches past the GEMVs' rows."""
    from test_model_parity import decode, extend, new_pool

    lean = load_model(None, "float32", progress=False, quantization="int4")
    dense = load_model(None, "float32", progress=False, quantization="int4", quantized_max_rows=8)
    assert lean.quantized_max_rows == -1 and dense.quantized_max_rows == 8
    projections = [m for m in lean.model.modules() if isinstance(m, Linear)]
    assert projections and all(m.weight.numel() == 0 for m in projections)
    assert isinstance(lean.model.output_weight, Q8Weight)  # the Q8_0 head serves every row

    assert lean.model.weight_bytes() < 0.25 * dense.model.weight_bytes()
    # Both output projections the same quantized weight, so only the layers' paths differ.
    dense.model.output_weight = lean.model.output_weight
    tok = lean.tokenizer
    prompts = [tok.encode(f"Count from {i} to {i + 9}, slowly, one by one:") for i in range(12)]
    assert sum(map(len, prompts)) >= 128  # the quantized GEMM's panel path for prefill
    logits = {}
    for name, loaded in (("lean", lean), ("dense", dense)):
        pool = new_pool(loaded)
        out, slots = extend(loaded, pool, prompts)
        steps = [out]
        for step in range(2):  # 12-row decode steps: the native step's quantized GEMM
            out, slots = decode(loaded, pool, [100 + step + i for i in range(12)], slots)
            steps.append(out)
        logits[name] = steps
    for a, b in zip(logits["lean"], logits["dense"], strict=True):
        assert (a - b).abs().max() < 2e-3


def _random_q4_k(rows: int, cols: int, seed: int):
    """Random but valid Q4_K blocks for a `[rows, cols]` tensor (small d and dmin)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full((len(blocks), 1), 0.004, np.float16).view(np.uint8)
    blocks[:, 2:4] = np.full((len(blocks), 1), 0.002, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def test_gguf_q4_k_projections_load_as_their_own_4_bit_values(tmp_path, monkeypatch):
    """A GGUF whose projections are Q4_K (as in the common Q4_K_M files): `--quantization int4`
    takes the file's own 4-bit values (each group's scale and offset are products of the
    block's, rounded to f16 by the int4 layout), rather than requantizing their dequantized
    weights, and the model computes what transformers computes on those weights."""
    import gguf
    from test_loader import PROMPT, hf_logits, last_logits, make_hf_model, write_tiny_gguf

    from sglite.runtime.model import gguf_loader

    hf = make_hf_model(
        "qwen2", str(tmp_path / "hf"), hidden_size=256, intermediate_size=512,
        tie_word_embeddings=True,
    )  # fmt: skip
    raw = {}
    with torch.no_grad():
        for i, (name, param) in enumerate(hf.state_dict().items()):
            if param.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name:
                blocks = _random_q4_k(*param.shape, seed=i)
                qtype = gguf.GGMLQuantizationType.Q4_K
                param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
                raw[name] = (blocks, qtype)
    path = str(tmp_path / "q4k.gguf")
    write_tiny_gguf(hf, "qwen2", path, raw=raw)
    tokenizer = str(tmp_path / "hf")
    loaded = load_model(path, "float32", tokenizer_path=tokenizer, progress=False,
                        quantization="int4")  # fmt: skip
    layer = loaded.model.get_submodule("layers.0.mlp.down_proj")
    assert isinstance(layer.quantized, Int4Weight) and layer.weight.numel() == 0
    from sglite.runtime.model import kernels

    q = layer.quantized
    got = kernels.int4_dequantize(q.packed, q.scale_offset, torch.float32)
    want = hf.model.layers[0].mlp.down_proj.weight
    step = want.abs().max() / 15
    assert (got - want).abs().max() < 0.01 * step  # the file's levels, not a requantization
    requantized = quantize_int4(want).dequantize()
    assert (requantized - want).abs().max() > 0.1 * step  # (which would move them this much)
    reference = hf_logits(hf, PROMPT)

    def logit_error(model) -> float:
        # The layers' error only, not the int8 output projection's: the reference's own head.
        model.model.output_weight = PlainWeight(hf.get_output_embeddings().weight.detach().float())
        return float((last_logits(model, PROMPT) - reference).abs().max())

    error = logit_error(loaded)
    assert error < 0.002 * reference.abs().max()
    # Requantizing the dequantized weights instead (as for other GGUF types) errs far more.
    monkeypatch.setattr(gguf_loader, "GGUF_INT4_TYPES", ("Q4_0", "Q4_1"))
    requantized = load_model(path, "float32", tokenizer_path=tokenizer, progress=False,
                             quantization="int4")  # fmt: skip
    assert logit_error(requantized) > 10 * error


def test_quantized_only_models_quantize_each_projection_as_it_loads(monkeypatch):
    """A model kept quantized only never holds all its dense weights: each projection is
    quantized, and its dense weight freed, as soon as its tensors are loaded (loading the
    default model with int4 peaked at 626 MiB resident instead of 936)."""
    from sglite.runtime.model import gguf_loader, weight_policy

    events: list[tuple[str, str]] = []
    real_iter, real_quantize = gguf_loader.iter_gguf_weights, weight_policy.quantize_projection

    def iter_logged(*args, **kwargs):
        for name, tensor in real_iter(*args, **kwargs):
            events.append(("load", name))
            yield name, tensor

    def quantize_logged(model, name, *args, **kwargs):
        events.append(("quantize", name))
        return real_quantize(model, name, *args, **kwargs)

    monkeypatch.setattr(gguf_loader, "iter_gguf_weights", iter_logged)
    monkeypatch.setattr(weight_policy, "quantize_projection", quantize_logged)
    loaded = load_model(None, "float32", progress=False, quantization="int4")
    quantized = [name for kind, name in events if kind == "quantize"]
    assert len(quantized) == len(set(quantized)) == 4 * loaded.config.num_layers
    done = events.index(("quantize", "layers.0.mlp.down_proj"))
    first_of_layer_2 = next(i for i, e in enumerate(events) if e[1].startswith("model.layers.2."))
    assert done < first_of_layer_2  # layer 0 was quantized before later layers loaded
    dense = load_model(None, "float32", progress=False, quantization="int4", quantized_max_rows=8)
    assert isinstance(dense.model.get_submodule("layers.0.mlp.down_proj").quantized, Int4Weight)


def test_server_with_auto_quantization_serves_the_gguf_4_bit_weights_alone():
    """`sglite serve --quantization auto` (float32 here) runs the default model's Q4_1
    projections as the file's own blocks, as vLLM and SGLang serve a GGUF quantized: no dense
    copy, the weights' memory reported by `/get_server_info`, and a batch of 12 greedy choices
    (a 12-row decode batch: the quantized GEMM in the native step) all alike and right, through
    the real OpenAI client."""
    import openai
    import requests
    from server_fixtures import ServerProcess

    server = ServerProcess("--quantization", "auto")
    try:
        info = requests.get(server.url + "/get_server_info", timeout=30).json()
        assert info["quantization"] == "q4_1" and info["quantized_max_rows"] == -1
        assert sum(info["weight_bytes_per_rank"]) < 300 * 2**20  # 1,117 MiB with a dense copy
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        out = client.completions.create(
            model="default", prompt="The capital of France is", max_tokens=8, temperature=0, n=12
        )
        texts = [choice.text for choice in out.choices]
        assert len(texts) == 12 and len(set(texts)) == 1
        assert "Paris" in texts[0], texts[0]  # not merely alike: right
    finally:
        server.stop()


def test_auto_quantization_follows_the_gguf_projections(tmp_path, engine):
    """auto (the default) runs a GGUF with its own quantization, per projection: the file's
    blocks as they are (the default model's Q4_1, Q8_0, Q4_K), dense for float projections,
    safetensors and CUDA; an explicit choice stands (the session engine, on defaults, runs the
    file's q4_1)."""
    import gguf
    from test_loader import make_hf_model, write_tiny_gguf

    from sglite.runtime.model.gguf_auto_quantization import auto_quantization
    from sglite.runtime.model.gguf_index import open_gguf
    from sglite.runtime.model.load_options import resolve_quantization
    from sglite.runtime.model.loader import default_model_path

    cpu, f32 = torch.device("cpu"), torch.float32
    default = open_gguf(default_model_path())
    assert auto_quantization(default) == "q4_1"
    assert resolve_quantization("auto", default, f32, cpu) == "q4_1"
    assert resolve_quantization("auto", default, torch.bfloat16, cpu) == "q4_1"
    assert resolve_quantization("auto", default, f32, torch.device("cuda")) == "none"
    assert resolve_quantization("auto", None, f32, cpu) == "none"  # safetensors
    assert resolve_quantization("int8", default, f32, cpu) == "int8"
    assert engine.get_server_info()["quantization"] == "q4_1"  # the default is auto

    hf = make_hf_model("qwen2", str(tmp_path / "hf"), hidden_size=256, intermediate_size=512)
    tokenizer = str(tmp_path / "hf")  # Q4_K blocks span 256 inputs

    def write(name: str, qtype_of) -> str:
        raw = {}
        for i, (key, param) in enumerate(hf.state_dict().items()):
            qtype = qtype_of(key) if param.dim() == 2 and "_proj." in key else None
            if qtype == gguf.GGMLQuantizationType.Q4_K:
                raw[key] = (_random_q4_k(*param.shape, seed=i), qtype)
            elif qtype is not None:
                raw[key] = (gguf.quants.quantize(param.float().numpy(), qtype), qtype)
        path = str(tmp_path / name)
        write_tiny_gguf(hf, "qwen2", path, raw=raw)
        return path

    q8 = write("q8.gguf", lambda key: gguf.GGMLQuantizationType.Q8_0)
    kinds = {"down_proj": gguf.GGMLQuantizationType.Q8_0, "up_proj": gguf.GGMLQuantizationType.Q4_K}
    mixed = write(  # 4-bit and 8-bit projections, F16 elsewhere
        "mixed.gguf", lambda key: next((t for part, t in kinds.items() if part in key), None)
    )
    floats = write("f16.gguf", lambda key: None)
    for path, want in [(q8, "q8_0"), (mixed, "q4_k+q8_0"), (floats, "none")]:
        assert resolve_quantization("auto", open_gguf(path), f32, cpu) == want, path
    loaded = load_model(q8, "float32", tokenizer_path=tokenizer, progress=False,
                        quantization="auto")  # fmt: skip
    assert loaded.quantization == "q8_0"
    layer = loaded.model.get_submodule("layers.0.mlp.down_proj")
    assert isinstance(layer.quantized, GGUFWeight) and layer.weight.numel() == 0
    # The file's own Q8_0 values, not a requantization of them.
    tensor = next(t for t in open_gguf(q8).tensors if t.name == "blk.0.ffn_down.weight")
    stored = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert torch.equal(layer.quantized.decoded(torch.float32), torch.from_numpy(stored))
    dense = load_model(floats, "float32", tokenizer_path=tokenizer, progress=False,
                       quantization="auto")  # fmt: skip
    assert dense.quantization == "none" and dense.quantized_max_rows is None


def test_default_answers_do_not_depend_on_batch_or_cache(engine):
    """The default (the file's q4_1 blocks) is weight-only (activations stay float32), so like
    the dense model its greedy answers do not change with the batch they decode in or with a
    cached prefix: each prompt alone, again from the cache, and all in one batch answer alike.
    (w4a8 rounds activations to int8 in the decode GEMVs; there a 16-row batch changed 13 of 16
    such answers.)"""
    topics = "rain sun moon cats dogs rivers trees stars music bread"
    prompts = [
        f"<|im_start|>user\nTell me a short fact about {word}.<|im_end|>\n<|im_start|>assistant\n"
        for word in topics.split()
    ]
    greedy = {"temperature": 0, "max_new_tokens": 32}
    assert engine.get_server_info()["quantization"] == "q4_1"  # the float32 default, auto
    engine.flush_cache()
    alone = [engine.generate(p, greedy)["text"] for p in prompts]
    cached = [engine.generate(p, greedy)["text"] for p in prompts]
    engine.flush_cache()
    batched = [out["text"] for out in engine.generate(prompts, greedy)]
    assert engine.check_invariants()["held_by_requests"] == 0
    assert cached == alone
    assert batched == alone


def test_gguf_q5_0_and_q8_0_load_exactly_as_q8_0_weights():
    """Q5_0 and Q8_0 blocks are integers times one f16 scale per 32: the q8_0 layout holds the
    file's values exactly (`--quantization auto` gives them to such projections)."""
    import gguf

    from sglite.runtime.model.gguf_quants import q8_weight_from_gguf_type

    torch.manual_seed(0)
    weight = torch.randn(48, 256).numpy()
    for qtype in (gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q8_0):
        blocks = gguf.quants.quantize(weight, qtype)
        q8 = q8_weight_from_gguf_type(blocks, qtype.name, (48, 256))
        want = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
        assert torch.equal(q8.dequantize(), want), qtype.name
        x = torch.randn(3, 256)
        torch.testing.assert_close(q8.matmul(x), x @ want.T, atol=1e-4, rtol=1e-5)
