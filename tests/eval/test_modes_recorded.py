"""gpu / cpu / hybrid tables from RECORDED runs (harness.run_config(modes_recorded=True), `psr eval
--record-modes`): a biased policy's windows scored again with experts_on cpu and hybrid,
the traces fed to the modes table through `modes.MODE_TRACES`."""

from __future__ import annotations

from dataclasses import replace

from tiny_models import tiny_model, write_checkpoint

from psr.eval import modes
from psr.eval.harness import EvalData, RunConfig, run_config
from psr.eval.quality import perplexity_items
from psr.policy import make_policy

PROFILES = ("rtx4090", "h200")


def test_recorded_modes_feed_the_modes_table_for_a_biased_policy(tmp_path) -> None:
    path = str(write_checkpoint(tiny_model("olmoe"), tmp_path / "m"))
    windows = [[(7 * i) % 60 + 1 for i in range(26)], [(5 * i + 3) % 60 + 1 for i in range(26)]]
    data = EvalData(windows=windows, prompt_len=10)
    steer = RunConfig(make_policy("psr", 0.3, 1), 0.5)
    r = run_config(path, steer, data, PROFILES, modes_recorded=True)
    rec = r["mode_traces"]
    gpu = r["trace"]
    caps = modes.hybrid_caps(PROFILES, gpu.top_k, rec["capacity"], rec["num_experts"])
    assert set(rec["traces"]) == {"cpu", *(f"hybrid:{m}" for m in caps.values())}
    assert set(rec["nll_items"]) == set(rec["traces"])
    for mode, t in rec["traces"].items():
        cap = int(mode.partition(":")[2] or 0)
        assert len(t.tokens) == len(gpu.tokens) == 32
        for tok in t.tokens:
            for s in tok:
                copied = sum(c.kind == "miss" for c in s.copies)
                # At most `cap` misses copied, the others computed on the CPU; the slab
                # read holds every routed expert but those.
                assert copied <= cap and (s.cpu_experts == 0 or copied == cap)
                assert s.hits + copied + s.cpu_experts == len(s.experts)
                assert len(s.slots) == len(s.experts) - s.cpu_experts
        assert t.counts()["cpu_experts"] > 0
    # The same policy loaded with experts_on="cpu" records the same cpu trace.
    model = steer.load(path, experts_on="cpu")
    try:
        own = model.record_trace()
        perplexity_items(model, data.windows, data.prompt_len)
    finally:
        model.close()
    assert own.trace.tokens == rec["traces"]["cpu"].tokens
    # The hook takes the recorded traces (with the gpu run's schedule), per profile's cap.
    for p in PROFILES:
        got = modes.MODE_TRACES(r, p)
        assert got is not None and got["gpu"] is gpu
        assert got["cpu"].tokens == rec["traces"]["cpu"].tokens
        assert got["hybrid"].tokens == rec["traces"][f"hybrid:{caps[p]}"].tokens
    text = modes.modes_appendix([r], PROFILES)
    assert "each mode recorded" in text and "exact routing only" not in text
    assert text.count("| rtx4090 |") == 3 and text.count("| h200 |") == 3
    # Without the hybrid run a profile's cap needs, a biased policy has no table (no replay).
    only_cpu = {**rec, "traces": {"cpu": rec["traces"]["cpu"]}}
    assert modes.MODE_TRACES({**r, "mode_traces": only_cpu}, "h200") is None
    # Exact is replayed, not recorded, and the replay still serves it.
    ex = run_config(path, RunConfig(make_policy("exact"), 0.5), data, PROFILES, modes_recorded=True)
    assert "mode_traces" not in ex and "mode_starts" in ex
    assert modes.MODE_TRACES(ex, "h200") is not None
    assert "exact routing only" in modes.modes_appendix([ex], PROFILES)
    # The model was handed back in gpu mode: a second gpu scoring repeats the first.
    again = run_config(path, steer, data, PROFILES)
    assert again["trace"].tokens == gpu.tokens
    assert replace(again["trace"], host=None) == replace(gpu, host=None)
