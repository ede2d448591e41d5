"""The on-disk cache of quantized expert rows (psr.load(..., quant_cache=)): a second load
reads the rows instead of quantizing, decodes identically, never writes into the model
folder, rebuilds a corrupt or stale file, and is refused where it means nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

import psr
import psr_kernels as pk
from psr.models import loader

PROMPT = [5, 17, 33, 2, 9, 41, 12, 60]


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path / "olmoe")


def load(path, fmt="int8", **kw):
    return psr.load(path, "psr", 0.5, lam=0.5, n=1, progress=False, expert_format=fmt, **kw)


def hosts(model) -> list[torch.Tensor]:
    st = model.runtime.store
    return [st.host(i).clone() for i in range(len(st.layers))]


def no_quantizing(monkeypatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("quantized although the cache holds the rows")

    monkeypatch.setattr(loader.pk, "quantize_expert", refuse)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_second_load_reads_the_cache_and_decodes_identically(ckpt, tmp_path, monkeypatch, fmt):
    cache = tmp_path / "cache"
    before = sorted(os.listdir(ckpt))
    a = load(ckpt, fmt, quant_cache=cache)
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".safetensors" and fmt in files[0].name
    assert sorted(os.listdir(ckpt)) == before  # nothing written into the model folder
    want_rows, want = hosts(a), a.generate(PROMPT, 12).tolist()
    no_quantizing(monkeypatch)
    b = load(ckpt, fmt, quant_cache=cache)
    assert all(torch.equal(x, y) for x, y in zip(hosts(b), want_rows, strict=True))
    assert b.generate(PROMPT, 12).tolist() == want
    # Without the cache the rows are the same, quantized again.
    monkeypatch.undo()
    c = load(ckpt, fmt)
    assert all(torch.equal(x, y) for x, y in zip(hosts(c), want_rows, strict=True))


def test_env_folder_and_one_file_per_format(ckpt, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PSR_CACHE", str(tmp_path / "home"))
    load(ckpt, "int8", quant_cache=True)
    load(ckpt, "fp8", quant_cache=True)
    names = sorted(p.name for p in (tmp_path / "home" / "quantized").iterdir())
    assert len(names) == 2 and "-fp8-" in names[0] and "-int8-" in names[1]


def test_a_corrupt_file_is_rebuilt_with_a_warning(ckpt, tmp_path) -> None:
    cache = tmp_path / "cache"
    want = hosts(load(ckpt, quant_cache=cache))
    (f,) = cache.iterdir()
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated
    with pytest.warns(UserWarning, match="ignoring the quantized-expert cache"):
        m = load(ckpt, quant_cache=cache)
    assert all(torch.equal(x, y) for x, y in zip(hosts(m), want, strict=True))
    (g,) = cache.iterdir()
    assert g == f and g.stat().st_size > 0
    load(ckpt, quant_cache=cache)  # rewritten whole: read back without a warning


def test_a_rewritten_checkpoint_gets_a_new_file(ckpt, tmp_path) -> None:
    cache = tmp_path / "cache"
    old = hosts(load(ckpt, quant_cache=cache))
    write_checkpoint(tiny_model("olmoe", seed=1), ckpt)  # retrained in place
    m = load(ckpt, quant_cache=cache)
    assert len(list(cache.iterdir())) == 2  # a new key; the old file is not read
    new = hosts(m)
    assert not all(torch.equal(x, y) for x, y in zip(new, old, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(new, hosts(load(ckpt)), strict=True))


def test_refused_where_it_means_nothing(ckpt, tmp_path) -> None:
    with pytest.raises(ValueError, match="quant_cache keeps quantized experts"):
        load(ckpt, None, quant_cache=tmp_path / "c")
    with pytest.raises(ValueError, match="inside the model folder"):
        load(ckpt, quant_cache=ckpt / "cache")
    with pytest.raises(TypeError, match="quant_cache must be True, False or a folder"):
        load(ckpt, quant_cache=3)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        load(ckpt, quant_cache=tmp_path / "f")
    assert pk.QUANT_FORMATS  # the error names these


def test_an_unwritable_folder_warns_and_still_loads(ckpt, tmp_path, monkeypatch) -> None:
    from psr.models import quant_cache

    def fail(*a, **k):
        raise OSError("No space left on device")

    monkeypatch.setattr(quant_cache.tempfile, "mkstemp", fail)
    with pytest.warns(UserWarning, match="could not write the quantized-expert cache"):
        m = load(ckpt, quant_cache=tmp_path / "c")
    assert m.generate(PROMPT, 4).shape[-1] > 0
