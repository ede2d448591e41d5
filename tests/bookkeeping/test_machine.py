"""psr.machine: hybrid's miss-copy cap from the machine's costs (a brute-force check of the
modeled layer time), the profile's file and its fingerprint warning."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from psr import machine as mc


def _brute(M: int, k: int, copy_s: float, fixed: float, cpu: float) -> int:
    """Every split of M misses into copied / computed, timed as two overlapping queues."""
    best = None
    for m in range(k + 1):
        copied = min(m, M)
        t = max(copied * copy_s, (fixed + (M - copied) * cpu) if M > copied else 0.0)
        if best is None or t < best[0]:
            best = (t, m)
    assert best is not None
    return best[1]


@pytest.mark.parametrize(
    ("copy_s", "fixed", "cpu"),
    list(itertools.product([1e-4, 4e-4], [0.0, 5e-5, 2e-3], [5e-5, 3e-4, 1e-3])),
)
def test_choose_inserts_minimises_the_modeled_layer_time(copy_s, fixed, cpu) -> None:
    for misses in (0, 1, 2.5, 4, 8):
        got = mc.choose_inserts(misses, 8, copy_s, fixed, cpu)
        assert got == _brute(int(-(-misses // 1)), 8, copy_s, fixed, cpu)


def test_the_extremes_copy_all_or_compute_all() -> None:
    assert mc.choose_inserts(4, 8, copy_s=1e-3, cpu_fixed_s=0.0, cpu_expert_s=1e-6) == 0
    # A fixed cost above all copies: copying every miss wins (FreeToken #151's trap).
    assert mc.choose_inserts(4, 8, copy_s=1e-4, cpu_fixed_s=1.0, cpu_expert_s=1e-6) == 4


@pytest.mark.parametrize("bad", [{"misses": 9}, {"copy_s": -1.0}, {"cpu_fixed_s": float("nan")}])
def test_choose_inserts_refuses_bad_input(bad) -> None:
    kw = dict(misses=2, top_k=8, copy_s=1e-4, cpu_fixed_s=1e-5, cpu_expert_s=1e-4) | bad
    with pytest.raises(ValueError, match="choose_inserts"):
        mc.choose_inserts(**kw)


def _profile(copy_s: float | None) -> mc.MachineProfile:
    fp = mc.fingerprint(1, "none", "0.0")
    shapes = {mc.shape_key(64, 32, "float32"): mc.ShapeCosts(24576, 1e-4, copy_s)}
    return mc.MachineProfile(fp, 1e-5, 1e10, shapes)


def test_hybrid_caps_from_a_profile_and_the_cpu_backend_default() -> None:
    keys = [mc.shape_key(64, 32, "float32")] * 2
    kw = dict(top_k=4, capacity=4, num_experts=8)
    want = mc.choose_inserts(2.0, 4, 5e-5, 1e-5, 1e-4)
    assert mc.hybrid_caps(_profile(5e-5), keys, backend="cuda", **kw) == [want, want]
    cpu_default = [mc.CPU_BACKEND_DEFAULT_M] * 2
    assert mc.hybrid_caps(None, keys, backend="cpu", **kw) == cpu_default
    assert mc.hybrid_caps(_profile(None), keys, backend="cpu", **kw) == cpu_default
    with pytest.raises(ValueError, match="psr bench machine"):
        mc.hybrid_caps(None, keys, backend="cuda", **kw)
    with pytest.raises(ValueError, match="psr bench machine"):
        mc.hybrid_caps(_profile(None), keys, backend="cuda", **kw)


def test_profile_round_trip_and_fingerprint_warning(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PSR_HOME", str(tmp_path))
    assert mc.read_profile() is None
    p = _profile(5e-5)
    assert mc.write_profile(p) == tmp_path / mc.MACHINE_FILE
    back = mc.read_profile()
    assert back == p
    assert mc.mismatch(back, p.fingerprint) is None
    other = dict(p.fingerprint, cpu="Some Other CPU", gpu="H200")
    msg = mc.mismatch(back, other)
    assert msg is not None and "\n" not in msg
    assert p.fingerprint["cpu"] in msg and "psr bench machine" in msg
    (tmp_path / mc.MACHINE_FILE).write_text("{}")
    with pytest.raises(ValueError, match="not a psr machine profile"):
        mc.read_profile()


@pytest.mark.parametrize("copy_s", [0.0, 5e-5, 1e-4, 2.5e-4, 3e-4, 1e-3, 0.7e-3])
@pytest.mark.parametrize("cpu", [1e-4, 3e-5, 0.1e-3])
def test_prefill_threshold_is_the_first_count_where_copying_is_no_dearer(copy_s, cpu) -> None:
    t = mc.prefill_threshold(copy_s, cpu)
    # brute force: below t the CPU's t * cpu is cheaper than one copy; at t it is not
    assert all(n * cpu < copy_s for n in range(1, t))
    assert t * cpu >= copy_s or t == 1


def test_prefill_split_from_a_profile_per_layer() -> None:
    prof = _profile(3.5e-4)  # CPU 1e-4 per token: 1..3 tokens on the CPU, 4 and up copied
    key, other = mc.shape_key(64, 32, "float32"), mc.shape_key(64, 32, "int8")
    split = mc.prefill_split(prof, [key, other, key])
    assert split.cpu_below == (4, mc.DEFAULT_PREFILL_CPU_BELOW, 4)  # int8: not measured
    assert split.active and hash(split) == hash(mc.PrefillSplit((4, 0, 4)))
    assert [split.on_cpu(0, n) for n in range(6)] == [False, True, True, True, False, False]
    assert not any(split.on_cpu(1, n) for n in range(6))
    assert mc.prefill_split(_profile(None), [key]) == mc.PrefillSplit.off(1)  # no GPU measured
    assert mc.prefill_split(None, [key, key]) == mc.PrefillSplit.off(2)
    assert not mc.PrefillSplit.off(2).active


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: mc.prefill_threshold(-1.0, 1e-4), "copy_s"),
        (lambda: mc.prefill_threshold(1e-4, 0.0), "cpu_expert_s must be > 0"),
        (lambda: mc.prefill_threshold(float("inf"), 1e-4), "copy_s"),
        (lambda: mc.PrefillSplit((2, -1)), "cpu_below"),
        (lambda: mc.PrefillSplit((2, True)), "cpu_below"),
    ],
)
def test_prefill_split_refuses_bad_input(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call()
