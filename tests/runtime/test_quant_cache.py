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


def count_quantizing(monkeypatch) -> list[int]:
    """Counts the experts quantized from here on."""
    calls = [0]
    real = loader.pk.quantize_expert

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(loader.pk, "quantize_expert", counted)
    return calls


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_second_load_reads_the_cache_and_decodes_identically(ckpt, tmp_path, monkeypatch, fmt):
    cache = tmp_path / "cache"
    before = sorted(os.listdir(ckpt))
    a = load(ckpt, fmt, quant_cache=cache)
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".safetensors" and fmt in files[0].name
    assert sorted(os.listdir(ckpt)) == before  # nothing written into the model folder
    want_rows, want = hosts(a), a.generate(PROMPT, 12).tolist()
    calls = count_quantizing(monkeypatch)
    b = load(ckpt, fmt, quant_cache=cache)
    assert calls[0] == len(want_rows)  # one spot-checked expert per layer, not all of them
    assert all(torch.equal(x, y) for x, y in zip(hosts(b), want_rows, strict=True))
    assert b.generate(PROMPT, 12).tolist() == want
    # Without the cache the rows are the same, every expert quantized again.
    calls[0] = 0
    c = load(ckpt, fmt)
    assert calls[0] == len(want_rows) * c.runtime.spec.num_experts
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
    (first,) = cache.iterdir()
    write_checkpoint(tiny_model("olmoe", seed=1), ckpt)  # retrained in place
    m = load(ckpt, quant_cache=cache)
    (second,) = cache.iterdir()  # a new key; the superseded file is removed
    assert second != first
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


@pytest.mark.parametrize("error", [OSError("No space left on device"), RuntimeError("os error 27")])
def test_a_failed_write_warns_and_still_loads(ckpt, tmp_path, monkeypatch, error) -> None:
    """safetensors reports a full disk as its own error type, not OSError."""
    import safetensors.torch

    def fail(*a, **k):
        raise error

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    with pytest.warns(UserWarning, match="could not write the quantized-expert cache"):
        m = load(ckpt, quant_cache=tmp_path / "c")
    assert m.generate(PROMPT, 4).shape[-1] > 0
    assert list((tmp_path / "c").iterdir()) == []  # no temporary file left behind


def test_rows_of_other_weights_under_this_key_are_caught(ckpt, tmp_path) -> None:
    """A file whose header fits (key, names, shapes) but whose rows came from other
    weights, as a copy that kept every size and timestamp could produce: the spot check
    re-quantizes one expert per layer and refuses it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    other = write_checkpoint(tiny_model("olmoe", seed=1), tmp_path / "other")
    load(other, quant_cache=tmp_path / "a")
    load(ckpt, quant_cache=tmp_path / "b")
    (fa,) = (tmp_path / "a").iterdir()
    (fb,) = (tmp_path / "b").iterdir()
    with safe_open(str(fa), "pt") as a, safe_open(str(fb), "pt") as b:
        forged = {k: a.get_tensor(k) for k in a.keys()}
        meta = b.metadata()
    save_file(forged, fb, metadata=meta)
    with pytest.warns(UserWarning, match="differs from this checkpoint's"):
        m = load(ckpt, quant_cache=tmp_path / "b")
    assert all(torch.equal(x, y) for x, y in zip(hosts(m), hosts(load(ckpt)), strict=True))
