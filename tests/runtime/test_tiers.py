"""`host_memory=`: experts beyond the budget stay in the checkpoint file and are read from
it; tokens and counts equal an unlimited load (the tier changes latency only), anonymous
memory stays within the budget, a read error mid-decode leaves the model usable, and bad
budgets are refused before loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf_files import gguf_tiny_model, write_gguf
from safetensors.torch import load_file, save_file
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.models.tiers import choose_held
from psr.runtime.verify import CpuVerify
from psr.vocab import parse_bytes

PROMPT = [5, 17, 33, 2, 9, 41, 12, 60, 7, 22, 3, 50]
NEW = 10
COUNTS = ("routed", "hits", "misses", "prefetches", "copies", "prefetch_used")
# cache-prior-async routes by which copies have landed: timing-dependent by design,
# whatever the tier, so it cannot be compared token for token under delays.
POLICIES = ("exact", "exact-prefetch", "cache-prior", "psr")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("tiers") / "olmoe")


def _load(path: Path, policy: str = "psr", **kw) -> psr.OffloadedModel:
    return psr.load(path, policy, slots=3, device="cpu", progress=False, **kw)


def _quarter(model: psr.OffloadedModel) -> int:
    """A CPU budget holding a quarter of the experts: dense + slab + 1/4 of the rows."""
    m = model.memory(context=1)
    return m["device_dense"] + m["device_slab"] + m["host_experts"] // 4


def _run(model: psr.OffloadedModel, delay: bool) -> tuple[list[int], dict[str, int]]:
    if delay:
        model.runtime.store.set_copy_delay(400, seed=7)
    out = model.generate(PROMPT, NEW).tolist()[0]
    s = model.stats
    return out, {k: s[k] for k in COUNTS}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_quarter_budget_changes_the_tier_not_tokens_or_counts(ckpt: Path, policy: str) -> None:
    ref = _load(ckpt, policy, host_memory="unlimited")
    want = _run(ref, delay=False)
    for decode in ("device", "host") if policy == "psr" else ("device",):
        m = _load(ckpt, policy, host_memory=_quarter(ref), decode=decode)
        store = m.runtime.store
        held = [store.tiers(i).count("held") for i in range(len(store.layers))]
        assert held == [2, 2, 2]  # 8 experts x 3 layers, a quarter: layer-balanced
        assert m.memory()["pageable_experts"] == 3 * m.memory()["host_experts"]
        assert _run(m, delay=True) == want, decode
        c = store.counters()
        assert c["bytes_pageable"] > 0 and c["read_errors"] == 0
        assert c["bytes_page_cache"] + c["bytes_disk"] == c["bytes_pageable"]
        m.close()
    ref.close()


def test_gguf_experts_stay_in_the_file_with_the_same_tokens(tmp_path: Path) -> None:
    model = gguf_tiny_model("qwen3_moe", experts=8)
    path = tmp_path / "m.gguf"
    write_gguf(model, path, {"experts": "Q8_0", "dense": "F32"})
    ref = psr.load(path, "psr", slots=3, device="cpu", progress=False, host_memory="unlimited")
    want = _run(ref, delay=False)
    m = psr.load(path, "psr", slots=3, device="cpu", progress=False, host_memory=_quarter(ref))
    assert m.memory()["pageable_experts"] > 0
    assert _run(m, delay=True) == want
    assert m.runtime.store.counters()["bytes_pageable"] > 0
    # The host rows a scored window reads: the file's blocks, as the unlimited load holds.
    for i in range(len(ref.runtime.store.layers)):
        assert torch.equal(m.runtime.store.host(i), ref.runtime.store.host(i))
    ref.close()
    m.close()


@pytest.mark.parametrize("decode", ["device", "host"])
def test_a_read_error_mid_decode_names_file_and_tensor_and_the_model_recovers(
    ckpt: Path, tmp_path: Path, decode: str
) -> None:
    # Experts in a shard of their own: the dense weights a loaded model uses stay mapped
    # from their file (safetensors' zero-copy tensors), so only the experts' shard is cut.
    work = tmp_path / "m"
    work.mkdir()
    (work / "config.json").write_bytes((ckpt / "config.json").read_bytes())
    sd = load_file(str(ckpt / "model.safetensors"))
    parts: dict[str, dict[str, torch.Tensor]] = {"experts.safetensors": {}, "dense.safetensors": {}}
    for k, v in sd.items():
        parts["experts.safetensors" if ".experts." in k else "dense.safetensors"][k] = v
    index = {"weight_map": {k: f for f, p in parts.items() for k in p}}
    for f, p in parts.items():
        save_file(p, str(work / f), metadata={"format": "pt"})
    (work / "model.safetensors.index.json").write_text(json.dumps(index))
    del sd, parts
    ref = _load(work, host_memory="unlimited")
    want = ref.generate(PROMPT, NEW).tolist()
    m = _load(work, host_memory=_quarter(ref), decode=decode, copy_retries=0)
    m.generate(PROMPT, 2)
    weights = work / "experts.safetensors"
    good = weights.read_bytes()
    os.truncate(weights, len(good) // 3)  # most experts' bytes are gone
    with pytest.raises(psr.CopyError, match=rf"{weights}.*tensor 'model\.layers\.\d+\.mlp"):
        for _ in range(3):
            m.generate([3, 1, 4, 1, 5, 9, 2, 6], 6)
    weights.write_bytes(good)
    assert m.generate(PROMPT, NEW).tolist() == want  # nothing half-written was kept
    store = m.runtime.store
    # The store's slot records are current under the host step (the device step hands its
    # state back at the next sequence's start): every slot holds its expert's bytes.
    for L in range(len(store.layers)):
        for slot, e in enumerate(store.slot_experts(L)):
            assert decode == "device" or e < 0 or store.verify(L, slot)
    m.close()
    ref.close()


def test_bad_budgets_are_refused_before_loading(ckpt: Path) -> None:
    ref = _load(ckpt, host_memory="unlimited")
    mem = ref.memory(context=1)
    ref.close()
    fixed = mem["device_dense"] + mem["device_slab"]
    with pytest.raises(ValueError, match="below what the model keeps in host memory"):
        _load(ckpt, host_memory=fixed - 1)
    with pytest.raises(ValueError, match="exceeds what this machine can hold: MemTotal"):
        _load(ckpt, host_memory="100TB")
    q = _load(ckpt, host_memory="unlimited", expert_format="int8")
    budget = _quarter(q)
    q.close()
    with pytest.raises(ValueError, match=r"cannot stay in the checkpoint file \(expert_format"):
        _load(ckpt, host_memory=budget, expert_format="int8")
    with pytest.raises(ValueError, match="host_memory must be a size like"):
        _load(ckpt, host_memory="48 parsecs")
    with pytest.raises(ValueError, match="host_profile must hold 3 lists"):
        _load(ckpt, host_memory=fixed, host_profile=[[1.0] * 8])
    with pytest.raises(ValueError, match="experts_on='cpu' computes misses from the host rows"):
        _load(ckpt, host_memory=fixed + mem["host_experts"] // 4, experts_on="cpu")
    paged = _load(ckpt, host_memory=fixed + mem["host_experts"] // 4)
    rule = CpuVerify([0] * len(paged.runtime.layers))
    with pytest.raises(ValueError, match="verify='cpu' computes experts from the host rows"):
        paged.runtime.set_block_mode(rule)  # speculative verify blocks read them too
    paged.close()
    with pytest.raises(TypeError, match="unexpected keyword argument 'host_mem'"):
        psr.load(ckpt, host_mem="1GB")  # type: ignore[call-arg]


def test_a_routing_profile_chooses_the_held_experts(ckpt: Path, tmp_path: Path) -> None:
    ref = _load(ckpt, host_memory="unlimited")
    budget = _quarter(ref)
    ref.close()
    counts = [[0.0] * 8 for _ in range(3)]
    for layer, hot in enumerate([(7, 6), (0, 5), (3, 4)]):
        for e in hot:
            counts[layer][e] = 10.0 + e
    (tmp_path / "profile.json").write_text(json.dumps({"counts": counts}))
    m = _load(ckpt, host_memory=budget, host_profile=tmp_path / "profile.json")
    held = [[e for e, t in enumerate(m.runtime.store.tiers(i)) if t == "held"] for i in range(3)]
    assert held == [[6, 7], [0, 5], [3, 4]]
    m.close()


def test_sizes_and_the_held_choice() -> None:
    assert parse_bytes("48GB") == 48 * 10**9 and parse_bytes("48GiB") == 48 * 2**30
    assert parse_bytes("1.5 MiB") == 3 * 2**19 and parse_bytes(4096) == 4096
    for bad in ("-1GB", "GB", "1 XB", -5):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    # Layer-balanced: rows handed out round-robin; a profile: the most-routed first.
    assert choose_held([10, 10], 4, 50) == [[0, 1, 2], [0, 1]]
    prof = [[0, 9, 0, 1], [5, 0, 7, 0]]
    assert choose_held([10, 10], 4, 30, prof) == [[1], [0, 2]]


_RSS_SCRIPT = r"""
import gc, json, sys, threading, time
import psr

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

# Warm-up on the tiny model: imports, kernels and thread pools are not the model's memory.
w = psr.load(sys.argv[3], "psr", slots=4, device="cpu", progress=False, decode="host")
w.generate([5, 17, 33, 2, 9, 41, 12, 60], 8)
w.close()
del w
gc.collect()
base, peak, stop = anon(), [0], threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)
t = threading.Thread(target=sample); t.start()
m = psr.load(sys.argv[1], "psr", slots=4, device="cpu", progress=False,
             host_memory=int(sys.argv[2]), decode="host")
m.generate([5, 17, 33, 2, 9, 41, 12, 60], 8)
stop.set(); t.join()
mem = m.memory(context=16)
print(json.dumps({"growth": peak[0] - base, **mem}))
"""


def test_anonymous_memory_stays_within_the_budget(ckpt: Path, tmp_path: Path) -> None:
    """RssAnon (anonymous memory: not the file's pages) during load and decode, measured
    in a fresh process: within budget + KV + 10% (on the CPU backend the budget already
    holds the dense weights and the slab), far below holding every expert."""
    import transformers

    cfg = tiny_model("olmoe").config.to_dict()
    cfg.update(hidden_size=128, intermediate_size=768, num_experts=32, num_hidden_layers=3)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.OlmoeConfig(**cfg))
    path = write_checkpoint(hf, tmp_path / "big")
    rows = 3 * 32 * 3 * 128 * 768 * 4  # every expert: 113 MiB
    dense = sum(p.numel() * 4 for n, p in hf.named_parameters() if ".experts." not in n)
    del hf
    budget = dense + 3 * 4 * rows // 96 + rows // 4  # dense + slab + a quarter of the rows
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(path), str(budget), str(ckpt)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["pageable_experts"] >= rows * 3 // 4 - rows // 96
    limit = 1.1 * (budget + r["device_kv"])
    assert r["growth"] <= limit, (r, limit)
    assert r["growth"] < dense + rows // 2  # an unlimited load would hold all rows


def test_inspect_the_cli_and_the_default_budget(ckpt: Path, monkeypatch) -> None:
    import argparse

    from psr.cli.args import host_memory
    from psr.models import tiers
    from psr.models.inspect import inspect

    got = inspect(ckpt)
    assert got.default_host_memory is None and "default: every expert held" in got.host_memory
    assert host_memory("48GiB") == "48GiB" and host_memory("unlimited") == "unlimited"
    with pytest.raises(argparse.ArgumentTypeError, match="must be a size like"):
        host_memory("lots")
    # A model that does not fit 80% of MemAvailable gets that as its default budget.
    monkeypatch.setattr(tiers, "meminfo", lambda: {"MemAvailable": 1000, "MemTotal": 2000})
    assert tiers.default_budget(300, 400) is None
    assert tiers.default_budget(300, 600) == 800


def test_traces_name_each_copys_tier_and_the_latency_model_prices_it(ckpt: Path) -> None:
    """A recorded copy of a pageable expert says so (Copy.tier), and the latency model
    reads it before copying it: the budgeted trace costs more than the same trace pinned."""
    from dataclasses import replace

    from psr.eval.latency import simulate

    ref = _load(ckpt, "psr", host_memory="unlimited")
    m = _load(ckpt, "psr", host_memory=_quarter(ref), decode="host")
    rec = m.record_trace()
    m.generate(PROMPT, NEW)
    copies = [c for tok in rec.trace.tokens for s in tok for c in s.copies]
    tiers = [m.runtime.store.tiers(c.layer)[c.expert] for c in copies]
    assert copies and {c.tier for c in copies} == {"pinned", "pageable"}
    assert [c.tier == "pageable" for c in copies] == [t == "pageable" for t in tiers]
    pinned = replace(
        rec.trace,
        tokens=[
            [replace(s, copies=[replace(c, tier="pinned") for c in s.copies]) for s in tok]
            for tok in rec.trace.tokens
        ],
    )
    assert simulate(rec.trace, "rtx4090").ms_per_token > simulate(pinned, "rtx4090").ms_per_token
    ref.close()
    m.close()
