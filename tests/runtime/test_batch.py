"""Batched decode (issue 38 items 1-3): each sequence's logits inside a batch are
bit-identical (torch.equal) to its solo run, whatever its co-runners, their join and leave
times, the copies' timing and where the experts run; the shared slab never evicts what a
step reads; `remove` frees everything; bad input refused in one line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from batch_runs import batched, solo
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.runtime.batch import BatchDecoder
from psr.runtime.batch_ops import DenseSeam, _row_invariant, batch_linear
from psr.runtime.batch_slab import SharedSlab
from psr.runtime.dense import QuantLinear
from psr.store import CopyReason


@pytest.fixture(scope="module")
def embedded() -> psr.OffloadedModel:
    return psr.load(psr.DEFAULT_MODEL, "psr", 0.5, progress=False)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batch")
    families = ("olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss")
    return {f: write_checkpoint(tiny_model(f), root / f) for f in families}


def _tiny(ckpts, family: str = "olmoe", **kw) -> psr.OffloadedModel:
    kw = {"lam": 0.3, "n": 1, **kw}
    return psr.load(ckpts[family], "psr", 0.25, progress=False, dtype="float32", **kw)


def _assert_solo(model, prompts, n, toks, logits) -> None:
    n = n if isinstance(n, list) else [n] * len(prompts)
    for j, p in enumerate(prompts):
        st, sl = solo(model, p, n[j])
        assert toks[j] == st, f"prompt {j}"
        assert torch.equal(logits[j].float(), sl), f"prompt {j}"


PROMPTS = [[5, 6, 7, 8, 9], [10, 20, 30, 17, 19, 23, 29, 31, 37], [42, 42, 42]]  # vocab 64


def test_embedded_model_rows_equal_solo_runs(embedded) -> None:
    toks, logits, dec = batched(embedded, PROMPTS, 10, joins=[0, 0, 3])
    _assert_solo(embedded, PROMPTS, 10, toks, logits)
    assert not any(dec.slab.refs)  # everything freed


def test_embedded_model_experts_on_cpu(embedded) -> None:
    embedded.set_experts_on("cpu")
    try:
        toks, logits, dec = batched(embedded, PROMPTS, 8, joins=[0, 1, 1])
        assert dec.stats["cpu_experts"] > 0
        _assert_solo(embedded, PROMPTS, 8, toks, logits)
    finally:
        embedded.set_experts_on("gpu")


@pytest.mark.parametrize("reads", ["host", "slab"])
@pytest.mark.parametrize("experts_on", ["gpu", "cpu", "hybrid:1"], ids=["all", "cpu", "hybrid"])
def test_random_co_runners_joins_leaves_and_copy_delays(ckpts, experts_on, reads) -> None:
    """`reads`: where the batch reads members from: the host rows (the CPU backend's) or,
    as on CUDA, the shared slab (2 slots per layer: runs of rows, copies, spills)."""
    model = _tiny(ckpts, experts_on=experts_on)
    model.runtime.prefill_reads = reads
    rng = random.Random(7)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(1, 14))] for _ in range(5)]
    n = [rng.randint(2, 9) for _ in prompts]
    joins = [rng.randint(0, 6) for _ in prompts]
    model.runtime.store.set_copy_delay(2000, seed=3)
    toks, logits, dec = batched(model, prompts, n, joins, max_batch=5)
    model.runtime.store.set_copy_delay(0)
    _assert_solo(model, prompts, n, toks, logits)
    if reads == "slab" and experts_on == "gpu":
        assert dec.slab.counts["shared"] > 0 and dec.slab.counts["spilled"] > 0
    assert (dec.slab.counts["copies"] > 0) == (reads == "slab")


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_shared_experts_dense_layers_and_latent_attention(ckpts, family) -> None:
    model = _tiny(ckpts, family)
    toks, logits, _ = batched(model, PROMPTS[:2], 6, joins=[0, 2])
    _assert_solo(model, PROMPTS[:2], 6, toks, logits)


def test_the_row_invariant_forward_switched_on_after_the_decoder_is_built(ckpts) -> None:
    """psr serve's forward with its prompt cache: its row-invariant linears then run once
    for all rows (the seam follows the model's forward), each row still its solo run."""
    model = _tiny(ckpts)
    dec = BatchDecoder(model, 3)
    model.set_row_invariant(True)
    toks, logits, _ = batched(model, PROMPTS, 6, joins=[0, 1, 3], dec=dec)
    _assert_solo(model, PROMPTS, 6, toks, logits)


def test_the_step_threads_follow_set_experts_on_and_the_forward(ckpts, monkeypatch) -> None:
    """A batched step runs torch's own ops on one thread when the model decodes on psr's
    kernels (decodes_on_kernels), asked again after set_row_invariant or set_experts_on
    changed what a step runs on, not at every step."""
    from psr.store import cpu_kernels

    model = _tiny(ckpts)
    dec = BatchDecoder(model, 2)
    asked: list[bool] = []
    answer = [True]

    def on_kernels() -> bool:
        asked.append(answer[0])
        return answer[0]

    monkeypatch.setattr(model, "decodes_on_kernels", on_kernels)
    used: list[int | None] = []  # each step's torch thread count (None: as they are)
    real = cpu_kernels.torch_ops_threads

    def spy(n: int | None = 1):  # type: ignore[no-untyped-def]
        used.append(n)
        return real(n)

    monkeypatch.setattr(cpu_kernels, "torch_ops_threads", spy)
    a = dec.add([1, 2, 3])
    last = int(dec.ready()[a].argmax())

    def steps(k: int) -> None:
        nonlocal last
        for _ in range(k):
            dec.feed({a: last})
            last = int(dec.ready()[a].argmax())

    steps(2)
    assert used[-2:] == [None, None]  # the decoder's first answer: a float checkpoint's
    model.set_experts_on("cpu")
    steps(2)
    assert asked == [True] and used[-2:] == [1, 1]  # asked once, then on one thread
    answer[0] = False
    model.set_row_invariant(True)
    steps(2)
    assert asked == [True, False] and used[-2:] == [None, None]


def test_chunked_prefill_interleaves_with_decode_steps(ckpts) -> None:
    model = _tiny(ckpts)
    model.set_prefill_chunk(4)
    long = list(range(3, 40))  # 10 chunks
    dec = BatchDecoder(model, 2)
    a = dec.add([1, 2, 3])
    first = dec.ready()
    b = dec.add(long)
    steps_while_b_prefills = 0
    toks = {a: [int(first[a].argmax())]}
    while b not in dec.ready():
        dec.feed({a: toks[a][-1]})
        toks[a].append(int(dec.ready()[a].argmax()))
        steps_while_b_prefills += 1
    assert steps_while_b_prefills == 10  # one chunk after each step: a never waited longer
    st, _ = solo(model, [1, 2, 3], len(toks[a]))
    assert toks[a] == st
    _, sl = solo(model, long, 1)
    assert torch.equal(dec.ready()[b], sl[0])


def test_a_solo_call_between_steps_changes_nothing(ckpts) -> None:
    model = _tiny(ckpts)
    dec = BatchDecoder(model, 2)
    s = [dec.add(p) for p in PROMPTS[:2]]
    while len(dec.ready()) < 2:
        dec.feed({})  # no step: the next queued prefill chunk
    got = {x: [] for x in s}
    for step in range(6):
        r = dec.ready()
        for x in s:
            got[x].append(r[x])
        if step == 2:
            model.generate([9, 9, 9, 1], max_new_tokens=4)  # moves slots, new solo sequence
        dec.feed({x: int(r[x].argmax()) for x in s})
    for j, x in enumerate(s):
        _, sl = solo(model, PROMPTS[j], 6)
        assert torch.equal(torch.stack(got[x]).float(), sl)


def test_generate_batch_equals_generate(ckpts) -> None:
    model = _tiny(ckpts)
    prompts = [PROMPTS[0], PROMPTS[1], [7], PROMPTS[2]]
    got = model.generate_batch(prompts, 6, max_batch=2)  # two join as two finish
    for p, g in zip(prompts, got, strict=True):
        assert g == model.generate(p, max_new_tokens=6)[0, len(p) :].tolist()
    sampled = model.generate_batch(
        prompts, 5, do_sample=True, temperature=0.8, top_k=20, seeds=[1, 2, 3, 4]
    )
    for j, (p, g) in enumerate(zip(prompts, sampled, strict=True)):
        alone = model.generate(p, max_new_tokens=5, do_sample=True, temperature=0.8, top_k=20,
                               seed=j + 1)  # fmt: skip
        assert g == alone[0, len(p) :].tolist()


def test_plain_batched_path_is_an_option(ckpts) -> None:
    model = _tiny(ckpts)
    toks, _, _ = batched(model, PROMPTS, 4, batch_invariant=False)
    assert [len(t) for t in toks] == [4, 4, 4]


def test_batch_linear_rows_are_one_row_calls() -> None:
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=g) for s in ((5, 1, 96), (80, 96), (80,)))
    rows = torch.cat([torch.nn.functional.linear(x[i], w, b) for i in range(5)])
    assert torch.equal(batch_linear(x, w, b, invariant=True).reshape(5, 80), rows)
    plain = batch_linear(x, w, b, invariant=False)
    assert torch.equal(plain, torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize(("experts", "dot"), [("Q8_0", "auto"), ("Q4_K", "q8"), ("Q4_K", "f32")])
def test_gguf_dense_blocks_run_once_for_all_rows(tmp_path: Path, experts: str, dot: str) -> None:
    """A GGUF's dense matrices kept in their blocks (QuantLinear: cpu_linear on the CPU,
    rows bit-identical for any T) run once over the batch, and every row still equals its
    solo run; experts on the CPU (one call for all rows too). Q4_K experts on the q8 dot
    path: the solo decode's CPU experts run in the store's hand-off (C++), the batch's
    from Python; both must take the process's dot path."""
    from gguf_files import gguf_tiny_model, write_gguf

    path = tmp_path / "q.gguf"
    types = {"experts": experts, "dense": lambda layer: "Q8_0" if layer == 0 else "Q4_K"}
    write_gguf(gguf_tiny_model("qwen3_moe", head_dim=64, vocab=256), path, types)
    model = psr.load(path, "psr", 0.5, device="cpu", experts_on="cpu", progress=False, cpu_dot=dot)
    quant = [m for m in model.hf.modules() if isinstance(m, QuantLinear)]
    norms = [m for m in model.hf.modules() if type(m).__name__ == "Qwen3MoeRMSNorm"]
    assert quant and norms and all(_row_invariant(m) for m in quant + norms)
    seam = DenseSeam(model.hf, invariant=True)
    assert not {id(m) for m in quant + norms} & {id(m) for m in [*seam.linears, *seam.leaves]}
    x = torch.randn(5, 1, quant[0].in_features)
    rows = torch.cat([quant[0](x[i : i + 1].clone()) for i in range(5)])
    assert torch.equal(quant[0](x), rows)  # the premise, on the model's own layer
    toks, logits, dec = batched(model, PROMPTS, 6, joins=[0, 0, 2])
    assert dec.stats["cpu_experts"] > 0
    _assert_solo(model, PROMPTS, 6, toks, logits)


def test_tiled_q4_k_rows_keep_every_row_equal_to_its_solo_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PSR_CPU_TILES=1: the CPU backend holds the Q4_K expert rows in tiles of 8 (and runs
    the Q4_K dense weights as tiles); every row of a batch still equals its solo run, and
    the logits stay those of the untiled load within the q8 path's rounding."""
    from gguf_files import gguf_tiny_model, write_gguf

    from psr.store import cpu_kernels as ck

    path = tmp_path / "q.gguf"
    types = {"experts": "Q4_K", "dense": lambda layer: "Q8_0" if layer == 0 else "Q4_K"}
    write_gguf(gguf_tiny_model("qwen3_moe", head_dim=64, vocab=256), path, types)
    loads = {}
    try:
        for on in ("1", "0"):
            monkeypatch.setenv(ck.CPU_TILES_ENV, on)
            ck.cpu_tiles_on.cache_clear()
            m = psr.load(path, "psr", 0.5, device="cpu", experts_on="cpu", progress=False,
                         cpu_dot="q8")  # fmt: skip
            assert all(c.expert_format.has_tiles == (on == "1") for c in m.runtime.computes)
            if on == "1":  # first: a forward before it would leave fewer misses
                toks, logits, dec = batched(m, PROMPTS, 6, joins=[0, 0, 2])
                assert dec.stats["cpu_experts"] > 0
                _assert_solo(m, PROMPTS, 6, toks, logits)
            loads[on] = m(torch.tensor([PROMPTS[1]]))
    finally:
        ck.cpu_tiles_on.cache_clear()  # the environment is restored after the test
    scale = float(loads["0"].abs().max())
    torch.testing.assert_close(loads["1"], loads["0"], rtol=0, atol=scale * 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norms_run_once_for_all_rows(dtype) -> None:
    """transformers' RMS norms (the audited bytecode) give each row of a batch bit-identically
    as alone, at row lengths on and off the vector width; other norms are not claimed."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    g = torch.Generator().manual_seed(0)
    for cls in (OlmoeRMSNorm, Qwen3MoeRMSNorm, GptOssRMSNorm):
        for H in (7, 33, 128, 2050):
            norm = cls(H).to(dtype)
            norm.weight.data = torch.randn(H, generator=g).to(dtype)
            assert _row_invariant(norm)
            x = (torch.randn(19, 1, H, generator=g) * 3).to(dtype)
            rows = torch.cat([norm(x[i : i + 1].clone()) for i in range(19)])
            assert torch.equal(norm(x), rows), (cls.__name__, H)
    assert not _row_invariant(GemmaRMSNorm(8))  # not audited: per row
    assert not _row_invariant(torch.nn.LayerNorm(8))


def test_shared_slab_evicts_unheld_slots_first_and_never_a_read_one(ckpts) -> None:
    model = _tiny(ckpts)  # 2 slots per layer of 8 experts
    store = model.runtime.store
    slab = SharedSlab(store, len(model.runtime.layers))
    where = slab.ensure(0, [3, 4], CopyReason.MISS)
    slab.hold(0, [3])
    where = slab.ensure(0, [5], CopyReason.MISS)  # 4 is held by no one: its slot goes
    assert 3 in where and 5 in where and 4 not in where
    where = slab.ensure(0, [6], CopyReason.PREFETCH, spill=False)  # 5 unheld, 3 held
    assert 3 in where and 6 in where
    slab.hold(0, [6])
    assert slab.ensure(0, [7], CopyReason.PREFETCH, spill=False).keys() == {3, 6}  # skipped
    assert slab.counts["skipped_prefetches"] == 1
    where = slab.ensure(0, [6, 7], CopyReason.MISS)  # spills held 3, never 6 (read now)
    assert set(where) == {6, 7} and slab.counts["spilled"] == 1
    with pytest.raises(RuntimeError, match="exceed the slab"):
        slab.ensure(0, [1, 2, 3], CopyReason.MISS)
    assert slab.groups(0, [[1, 2], [2], [3], [4, 5]]) == [[0, 1], [2], [3]]
    slab.drop(0, [3, 6])
    assert not slab.refs[0]


def test_remove_frees_and_bad_input_is_refused(ckpts) -> None:
    model = _tiny(ckpts)
    dec = BatchDecoder(model, 2)
    a, b = dec.add([1, 2]), dec.add([3])
    with pytest.raises(ValueError, match="batch is full"):
        dec.add([4])
    r = dec.ready()
    with pytest.raises(ValueError, match="not an id"):
        dec.feed({a: 10_000})
    dec.feed({a: int(r[a].argmax())})
    dec.remove(b)
    c = dec.add([5, 6])  # queued: its prefill runs after the next step
    with pytest.raises(ValueError, match="not awaiting"):
        dec.feed({c: 1})
    for s in (a, c):
        dec.remove(s)
    assert not dec.live and not any(dec.slab.refs)
    with pytest.raises(KeyError, match="no live sequence"):
        dec.remove(a)
    with pytest.raises(ValueError, match="max_batch"):
        BatchDecoder(model, 0)
    with pytest.raises(ValueError, match="empty prompt"):
        dec.add([])
    async_model = psr.load(ckpts["olmoe"], "cache-prior-async", 0.25, progress=False)
    with pytest.raises(ValueError, match="logical-cache policy"):
        BatchDecoder(async_model, 2)


def test_kv_beyond_the_budget_waits_or_is_refused_never_evicts(ckpts) -> None:
    """kv_tokens: a prompt longer than the budget is refused; a prefill that does not fit
    beside the others' KV waits until one leaves; a step that would pass it is refused with
    nothing changed; every sequence's logits stay its solo run's."""
    model = _tiny(ckpts)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="kv_tokens must be an int >= 1"):
            BatchDecoder(model, 2, kv_tokens=bad)
    dec = BatchDecoder(model, 2, kv_tokens=12)
    with pytest.raises(ValueError, match=r"a prompt of 13 tokens exceeds the batch's KV budget"):
        dec.add(list(range(1, 14)))
    a, b = dec.add(PROMPTS[0]), dec.add(PROMPTS[1])  # 5 + 9 > 12: b's prefill waits
    got: list[torch.Tensor] = []
    for _ in range(8):  # a: 5 prompt tokens + 7 steps = 12
        r = dec.ready()
        assert list(r) == [a] and dec.kv_held <= 12
        got.append(r[a])
        if len(got) < 8:
            dec.feed({a: int(r[a].float().argmax())})
    with pytest.raises(ValueError, match=r"would hold 13 KV tokens, beyond the batch's kv_tok"):
        dec.feed({a: int(got[-1].float().argmax())})
    assert dec.kv_held == 12 and torch.equal(dec.ready()[a], got[-1])  # nothing changed
    assert torch.equal(torch.stack(got).float(), solo(model, PROMPTS[0], 8)[1])
    dec.remove(a)
    got = []
    for _ in range(4):  # b: 9 + 3 steps
        r = dec.ready()
        got.append(r[b])
        if len(got) < 4:
            dec.feed({b: int(r[b].float().argmax())})
    assert torch.equal(torch.stack(got).float(), solo(model, PROMPTS[1], 4)[1])


def test_reservations_make_every_step_fit_the_kv_budget(ckpts) -> None:
    """add(prompt, max_new_tokens) under kv_tokens reserves prompt + max_new_tokens: one
    beyond the budget is refused naming the numbers, one beside too large a reservation
    waits (`waits`, and `add` refuses it with nothing changed) until a sequence leaves;
    the admitted ones' steps all fit, each sequence's logits its solo run's."""
    from psr.runtime.batch import KVBudgetExceeded

    model = _tiny(ckpts)
    dec = BatchDecoder(model, 3, kv_tokens=20)
    one_line = (
        r"^a prompt of 9 tokens \+ max_tokens 12 exceeds the batch's KV budget of 20 tokens "
        r"\(kv_tokens\): lower max_tokens$"
    )
    with pytest.raises(KVBudgetExceeded, match=one_line):
        dec.add(PROMPTS[1], 12)
    assert not dec.live
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        dec.waits(5, 0)
    assert dec.reservation(5, 8) == 13 and not dec.waits(5, 8)
    a = dec.add(PROMPTS[0], 8)  # 13 reserved
    assert dec.kv_reserved == 13
    assert dec.waits(9, 4) and not dec.waits(3, 4)  # 13 + 13 > 20, 13 + 7 fits
    with pytest.raises(ValueError, match="do not fit beside the live sequences' 13"):
        dec.add(PROMPTS[1], 4)
    assert dec.live == [a]
    c = dec.add(PROMPTS[2], 4)  # 3 + 4: 20 reserved, the whole budget
    got: dict[int, list[torch.Tensor]] = {a: [], c: []}
    want, b, joined_after = {a: 8, c: 4}, None, None
    while dec.live or b is None:
        if b is None and not dec.waits(9, 4):  # b waits until a leaves (c's 7 is not enough)
            b, joined_after = dec.add(PROMPTS[1], 4), len(got[a])
            got[b], want[b] = [], 4
        feed = {}
        for s, lg in dec.ready().items():
            got[s].append(lg)
            if len(got[s]) == want[s]:
                dec.remove(s)  # frees its reservation
            else:
                feed[s] = int(lg.float().argmax())
        dec.feed(feed)  # never refused: the live reservations fit
        assert dec.kv_held <= dec.kv_reserved <= 20
    assert joined_after == 8  # it started once a had left
    for s, p in ((a, PROMPTS[0]), (b, PROMPTS[1]), (c, PROMPTS[2])):
        assert torch.equal(torch.stack(got[s]).float(), solo(model, p, want[s])[1])
    assert dec.kv_reserved == 0 and not dec.waits(9, 11)  # all freed: the budget whole


def test_recorded_batch_trace_counts_each_copy_once_and_prices(ckpts) -> None:
    """record_trace: one trace token per batch step; each layer step the union of its rows'
    experts and the shared slab's copies (each once, however many rows need it); the
    latency model prices it."""
    from psr.eval.latency import simulate

    model = _tiny(ckpts)
    model.runtime.prefill_reads = "slab"  # members through the shared slab (copies)
    dec = BatchDecoder(model, 3)
    for p in PROMPTS:
        dec.add(p)
    r = dec.ready()
    while len(r) < 3:
        dec.feed({s: int(lg.float().argmax()) for s, lg in r.items()})
        r = dec.ready()
    trace = dec.record_trace()
    before = dec.slab.counts["copies"]
    for _ in range(4):
        dec.feed({s: int(lg.float().argmax()) for s, lg in r.items()})
        r = dec.ready()
    assert len(trace.tokens) == 4
    copies = [c for tok in trace.tokens for s in tok for c in s.copies]
    assert len(copies) == dec.slab.counts["copies"] - before > 0
    for tok in trace.tokens:
        assert [s.layer for s in tok] == list(range(len(model.runtime.layers)))
        for s in tok:
            assert len(s.slots) == len(s.experts) and min(s.slots) >= 0
            assert model.runtime.spec.top_k <= len(s.experts) <= 3 * model.runtime.spec.top_k
            assert not {c.expert for c in s.copies if c.kind == "miss"} - set(s.experts)
    assert simulate(trace, "rtx4090").ms_per_token > 0


def test_attention_a_batch_cannot_run_per_sequence_is_refused(ckpts) -> None:
    model = psr.load(ckpts["gpt_oss"], "exact", 0.5, progress=False)
    with pytest.raises(ValueError, match="sliding windows"):
        BatchDecoder(model, 2)


def test_prefill_staged_through_the_shared_slab(ckpts) -> None:
    model = _tiny(ckpts)
    model.runtime.prefill_reads = "slab"  # as on CUDA: each expert staged through a slot
    model.runtime.store.set_copy_delay(1000, seed=1)
    toks, logits, dec = batched(model, PROMPTS, 5, joins=[0, 2, 2])
    _assert_solo(model, PROMPTS, 5, toks, logits)
    assert dec.slab.counts["copies"] > 0


def test_each_sequence_counts_its_solo_runs_routing(embedded) -> None:
    """seq_stats: a sequence's logical counts over its decode steps, whatever shares them,
    equal its solo generate's (psr serve reports them per request)."""
    keys = ("routed", "hits", "misses", "prefetches", "prefetch_used", "substituted")
    n = 9
    want = []
    for p in PROMPTS:
        before = dict(embedded.stats.totals)
        embedded.generate(p, max_new_tokens=n)
        after = embedded.stats.totals
        want.append({k: int(after[k] - before.get(k, 0)) for k in keys})
    dec = BatchDecoder(embedded, 3)
    seqs = [dec.add(p) for p in PROMPTS]
    made = dict.fromkeys(seqs, 0)
    got: dict[int, dict[str, int]] = {}
    while dec.live:
        tokens = {}
        for s, logits in dec.ready().items():
            made[s] += 1
            if made[s] == n:
                got[s] = dec.seq_stats(s)
                dec.remove(s)
            else:
                tokens[s] = int(logits.argmax())
        dec.feed(tokens)
    assert [{k: got[s].get(k, 0) for k in keys} for s in seqs] == want
    assert want[0]["routed"] > 0
    with pytest.raises(KeyError, match="no live sequence"):
        dec.seq_stats(seqs[0])


@pytest.mark.slow  # ~13 s: the Triton interpreter
def test_kernel_ops_route_row_by_row(ckpts) -> None:
    """The Triton ops (under the interpreter here) route and predict each row in its own
    call on a fresh row: the rows still equal their solo runs."""
    model = _tiny(ckpts, compute="triton", decode="host")
    assert model.runtime.ops.path == "triton"
    prompts = [PROMPTS[2], PROMPTS[0][:3]]
    toks, logits, dec = batched(model, prompts, 3, joins=[0, 0])
    assert dec.stats["steps"] < dec.stats["tokens"]  # some step ran both rows
    _assert_solo(model, prompts, 3, toks, logits)
    model.close()
