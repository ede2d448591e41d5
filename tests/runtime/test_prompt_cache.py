"""Chunked prefill and the prompt cache (issue 36): the caches are seeded from the routed
ids alone whatever the chunking; a prompt-cache hit changes nothing (tokens, logits and
decode counts bit-identical to the same request without the cache) for every policy,
both decode steps, under copy delays, on both prefill read paths, resumed at any cached
prefix (the row-invariant CPU forward, the default) or at a chunk boundary (a forward
that rounds by chunk), alone or inside a batch (BatchDecoder: a newcomer resumes from the
cache, whatever its co-runners and the copies' timing); entries never cross models or
configurations; the budget counts a packed KV format's bytes; bad input refused in one
line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from batch_runs import batched, shared_prefix, solo
from tiny_models import tiny_model, write_checkpoint

import psr
from psr.cache import prefill_state
from psr.runtime.batch import BatchDecoder
from psr.runtime.chunked import PromptCache, boundaries
from psr.runtime.kv import kv_bytes
from psr.store import cpu_dot, set_cpu_dot

CHUNK = 8
FIRST = torch.arange(40).remainder(61)[None] * 7 % 64  # a 40-token first turn
SECOND = torch.cat([FIRST, torch.arange(21)[None] * 5 % 64], dim=1)  # extends it: 61 tokens
NEW = 6
COUNTS = ("tokens", "routed", "hits", "misses", "prefetches")
POLICIES = [
    ("exact", {}),
    ("exact-prefetch", {"n": 1}),
    ("cache-prior", {"lam": 0.3}),
    ("psr", {"lam": 0.3, "n": 1}),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("pc") / "olmoe")


def _load(path: Path, policy: str, **kw) -> psr.OffloadedModel:
    model = psr.load(path, policy, 0.5, progress=False, **kw)
    model.set_prefill_chunk(CHUNK)
    if not kw.get("graphs"):
        model.set_row_invariant(True)  # the prompt cache's forward (psr serve's)
    return model


def _gen(model, ids, cache=None):
    """Tokens, every decode step's float32 logits, and the decode counts of one request."""
    seen: list[torch.Tensor] = []

    def keep(_ids, scores):
        seen.append(scores.clone())
        return scores

    model.reset_stats()
    out = model.generate(ids, max_new_tokens=NEW, logits_processor=keep, prompt_cache=cache)
    s = model.stats
    return out[0].tolist(), torch.stack(seen), {k: s[k] for k in COUNTS}


def test_boundaries_are_absolute() -> None:
    assert boundaries(0, 20, 8) == [8, 16, 20]
    assert boundaries(16, 20, 8) == [20]
    assert boundaries(0, 16, 8) == [8, 16]
    assert boundaries(8, 30, 8) == [16, 24, 30]


@pytest.mark.parametrize("rows", [True, False], ids=["any-length", "boundaries"])
@pytest.mark.parametrize("decode", ["device", "host"])
@pytest.mark.parametrize(("policy", "kw"), POLICIES, ids=[p for p, _ in POLICIES])
def test_a_hit_changes_nothing(ckpt, monkeypatch, policy, kw, decode, rows) -> None:
    monkeypatch.setenv("PSR_COPY_DELAY_US", "2000")
    monkeypatch.setenv("PSR_COPY_DELAY_SEED", "3")
    model = _load(ckpt, policy, decode=decode, **kw)
    model.set_row_invariant(rows)
    miss = _gen(model, SECOND)
    cache = PromptCache(1 << 26)
    _gen(model, FIRST, cache)
    # boundaries 8, 16, 24, 32 (< 40); a row-invariant forward keeps the end (40) in place
    # of them (cut, it gives their states)
    assert cache.last_cached == 0 and len(cache) == (1 if rows else 4)
    hit = _gen(model, SECOND, cache)
    # the longest cached prefix before 61: the first turn's end, else its last boundary
    assert cache.last_cached == (40 if rows else 32)
    assert hit[0] == miss[0] and hit[2] == miss[2]
    assert torch.equal(hit[1], miss[1])  # bit-identical
    # the same request again: its own boundaries (up to 56) were kept by the hit, and a
    # row-invariant forward resumes at its last token (its kept end, cut by one)
    again = _gen(model, SECOND, cache)
    assert cache.last_cached == (60 if rows else 56)
    assert again[0] == miss[0] and again[2] == miss[2] and torch.equal(again[1], miss[1])


PARTS = 27  # FIRST and the prompt below share 27 tokens: between boundaries 24 and 32
APART = torch.cat([FIRST[:, :PARTS], torch.arange(9)[None] * 3 % 64 + 1], dim=1)


@pytest.mark.parametrize("kv_format", ["auto", "int8"])
@pytest.mark.parametrize("decode", ["device", "host"])
@pytest.mark.parametrize("rows", [True, False], ids=["any-length", "boundaries"])
def test_a_prompt_that_parts_from_a_cached_one_resumes_where_they_part(
    ckpt, monkeypatch, rows, decode, kv_format
) -> None:
    """Another request with the same first tokens (a shared system prompt, a chat template
    that rewrites the last turn): a row-invariant forward resumes at the last shared token,
    cutting a longer entry there; a forward that rounds by chunk at the last boundary. The
    tokens, logits and counts are the cold run's, and the longer entry, cut for it, still
    serves its own prompt unchanged."""
    monkeypatch.setenv("PSR_COPY_DELAY_US", "2000")
    monkeypatch.setenv("PSR_COPY_DELAY_SEED", "5")
    model = _load(ckpt, "psr", lam=0.3, n=1, decode=decode, kv_format=kv_format)
    model.set_row_invariant(rows)
    rt = model.runtime

    def run(ids, cache=None):  # with each prompt token's routed ids (the seeds' source)
        return *_gen(model, ids, cache), rt.histories()

    cold = [run(ids) for ids in (APART, FIRST)]
    assert [len(h) for h in cold[0][3]] == [APART.shape[1]] * len(rt.layers)
    cache = PromptCache(1 << 26)
    _gen(model, FIRST, cache)
    assert FIRST[0, PARTS] != APART[0, PARTS]
    hit = run(APART, cache)
    assert cache.last_cached == (PARTS if rows else 24)
    again = run(FIRST, cache)  # after the cut entry served APART
    assert cache.last_cached == (FIRST.shape[1] - 1 if rows else 32)
    for got, want in zip((hit, again), cold, strict=True):
        assert got[0] == want[0] and got[2] == want[2] and got[3] == want[3]
        assert torch.equal(got[1], want[1])  # bit-identical


def test_an_end_replaces_its_boundaries_and_the_shortest_past_the_parting_is_cut(ckpt) -> None:
    """A row-invariant forward keeps a prompt's end, which replaces its boundary entries (8
    to 32: cut, it gives their states). APART leaves FIRST after 27 tokens and OTHER after
    30, so OTHER's 35-token entry is cut, the least to drop. A forward that rounds by chunk
    keeps its boundaries, none cuttable: the 24-token one is taken whole. A prompt that
    shares nothing resumes nowhere."""
    model = _load(ckpt, "exact")
    cache = PromptCache(1 << 26)
    _gen(model, FIRST, cache)
    assert len(cache) == 1
    other = torch.cat([FIRST[:, :30], (FIRST[:, 30:35] + 1) % 64], dim=1)
    _gen(model, other, cache)
    assert cache.last_cached == 30 and len(cache) == 2
    key = model._prefill_key(False)
    n, entry = cache.lookup(key, APART[0], any_length=True)
    assert (n, entry.tokens, entry.cuttable) == (PARTS, 35, True)
    assert cache.lookup(key, APART[0]) == (0, None)  # no whole prefix of it is cached
    assert cache.lookup(key, (FIRST[0] + 1) % 64, any_length=True) == (0, None)
    with pytest.raises(ValueError, match="entry of 35 tokens cannot resume at 36"):
        entry.restore(length=36)
    model.set_row_invariant(False)
    chunked = PromptCache(1 << 26)
    _gen(model, FIRST, chunked)
    key = model._prefill_key(False)
    assert len(chunked) == 4  # 8, 16, 24, 32
    n, entry = chunked.lookup(key, APART[0], any_length=True)
    assert (n, entry.tokens, entry.cuttable) == (24, 24, False)


def test_only_a_cache_holding_every_token_cuts_exactly() -> None:
    """A window layer that dropped its first tokens, or a layer that caches nothing, cannot
    give the state at a shorter prefix: its entry resumes only whole."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    from psr.runtime.chunked import cuts_exactly, kv_snapshot

    def cache(*layers):
        kv = DynamicCache()
        kv.layers = list(layers)
        return kv

    def filled(layer, n):
        layer.update(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4))
        return layer

    full = lambda n: filled(DynamicLayer(), n)  # noqa: E731
    window = lambda n: filled(DynamicSlidingWindowLayer(sliding_window=5), n)  # noqa: E731
    for layers, n, want in [
        ((full(6), full(6)), 6, True),
        ((full(4), window(4)), 4, True),  # below its window: every token held
        ((full(6), window(6)), 6, False),  # 4 of 6 held
        ((full(6), DynamicLayer()), 6, False),  # caches nothing
    ]:
        snap = kv_snapshot(cache(*layers), n)
        assert snap is not None and cuts_exactly(snap[0], n) is want


def test_the_slab_path_is_reproducible_and_its_hits_change_nothing(ckpt, monkeypatch) -> None:
    """Prefill staged through slots with the next copy in flight (CUDA's path), forced on
    the CPU: copy delays and a cache hit change nothing."""

    def run(delay: int, cache: PromptCache | None):
        monkeypatch.setenv("PSR_COPY_DELAY_US", str(delay))
        model = _load(ckpt, "psr", lam=0.3, n=1)
        model.runtime.prefill_reads = "slab"
        if cache is not None:
            _gen(model, FIRST, cache)
        out = _gen(model, SECOND, cache)
        assert model.stats["prefill_copies"] > 0  # prefill staged through the slab
        return out

    base = run(0, None)
    for got in (run(3000, None), run(3000, PromptCache(1 << 26))):
        assert got[0] == base[0] and got[2] == base[2] and torch.equal(got[1], base[1])


def test_the_seed_is_a_function_of_the_routed_ids_whatever_the_chunking(ckpt) -> None:
    model = psr.load(ckpt, "psr", 0.5, lam=0.3, n=1, progress=False)
    seen = []
    for chunk in (SECOND.shape[1], 16, 5):
        model.set_prefill_chunk(chunk)
        model.generate(SECOND, max_new_tokens=1)  # prefill and the first token: no decode
        rt = model.runtime
        seeds = [L.cache.order() for L in rt.layers]
        hist = rt.histories()
        assert seeds == [prefill_state(h, rt.capacity) for h in hist]
        assert all(len(h) == SECOND.shape[1] for h in hist)
        seen.append((seeds, hist, model.generate(SECOND, max_new_tokens=NEW)[0].tolist()))
    assert all(s == seen[0] for s in seen[1:])  # same routed ids, seeds, first tokens


def test_entries_never_cross_models_or_configurations(ckpt) -> None:
    cache = PromptCache(1 << 26)
    a = _load(ckpt, "psr", lam=0.3, n=1)
    b = _load(ckpt, "psr", lam=0.3, n=1)
    a.generate(FIRST, max_new_tokens=1, prompt_cache=cache)
    b.generate(SECOND, max_new_tokens=1, prompt_cache=cache)
    assert cache.last_cached == 0  # another model
    a.configure("exact", 0.5)
    a.generate(SECOND, max_new_tokens=1, prompt_cache=cache)
    assert cache.last_cached == 0  # another policy
    a.configure("psr", 0.5, lam=0.3, n=1)
    a.set_prefill_chunk(2 * CHUNK)
    a.generate(SECOND, max_new_tokens=1, prompt_cache=cache)
    assert cache.last_cached == 40  # row-invariant: the chunk does not matter, FIRST's end
    a.set_row_invariant(False)
    a.generate(SECOND, max_new_tokens=1, prompt_cache=cache)
    assert cache.last_cached == 0  # another forward
    a.set_prefill_chunk(CHUNK)
    a.generate(SECOND, max_new_tokens=1, prompt_cache=cache)
    assert cache.last_cached == 0  # another chunking (the chunk-dependent forward's key)
    a.generate(SECOND, max_new_tokens=1, prompt_cache=cache)
    assert cache.last_cached == 56
    was = cpu_dot()
    try:  # the CPU kernels' dot path is process-wide: another load may change it
        set_cpu_dot("f32" if was != "f32" else "q8")
        a.generate(SECOND, max_new_tokens=1, prompt_cache=cache)
        assert cache.last_cached == 0  # another dot path
    finally:
        set_cpu_dot(was)


def test_the_budget_bounds_the_cache(ckpt) -> None:
    model = _load(ckpt, "exact")
    prompts = [(FIRST + i) % 64 for i in range(3)]  # none shares a first token
    big = PromptCache(1 << 26)
    for p in prompts:
        model.generate(p, max_new_tokens=1, prompt_cache=big)
    assert len(big) == 3  # each prompt's end
    small = PromptCache(2 * big.nbytes // 3)
    for p in prompts:
        model.generate(p, max_new_tokens=1, prompt_cache=small)
    assert len(small) == 2 and small.nbytes <= small.max_bytes
    model.generate(prompts[0], max_new_tokens=1, prompt_cache=small)
    assert small.last_cached == 0  # the least recently used was dropped
    model.generate(prompts[2], max_new_tokens=1, prompt_cache=small)
    assert small.last_cached == FIRST.shape[1] - 1  # the most recent kept


def test_bad_input_is_refused_in_one_line(ckpt) -> None:
    model = psr.load(ckpt, "exact", 0.5, progress=False)
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        model.set_prefill_chunk(0)
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"exceeds the model's context of {limit}"):
        model.set_prefill_chunk(limit + 1)
    with pytest.raises(ValueError, match="prompt cache budget must be an int >= 1"):
        PromptCache(0)
    model.set_prefill_chunk(CHUNK)
    with pytest.raises(ValueError, match="below one prefill chunk's KV"):
        model.generate(FIRST, max_new_tokens=1, prompt_cache=PromptCache(16))
    with pytest.raises(TypeError, match="prompt_cache must be a psr PromptCache"):
        model.generate(FIRST, max_new_tokens=1, prompt_cache={})
    with pytest.raises(ValueError, match="below one prefill chunk's KV"):
        BatchDecoder(model, 2, prompt_cache=PromptCache(16))
    with pytest.raises(TypeError, match="prompt_cache must be a psr PromptCache"):
        BatchDecoder(model, 2, prompt_cache={})  # type: ignore[arg-type]


def test_a_hit_changes_nothing_through_a_static_cache(ckpt) -> None:
    """graphs=True: prefill runs through the decode graph's static KV cache, and a hit
    refills it in place (two new tokens: the graph's first decode step is eager, so
    nothing compiles here; tests/runtime/test_graphs.py covers the replays)."""
    model = _load(ckpt, "psr", lam=0.3, n=1, graphs=True)
    seen: list[torch.Tensor] = []

    def run(ids, cache=None):
        seen.clear()
        out = model.generate(
            ids, max_new_tokens=2, prompt_cache=cache,
            logits_processor=lambda _i, s: (seen.append(s.clone()), s)[1],
        )  # fmt: skip
        return out[0].tolist(), torch.stack(seen)

    miss = run(SECOND)
    assert model.graph_status.startswith("on")
    cache = PromptCache(1 << 26)
    run(FIRST, cache)
    hit = run(SECOND, cache)
    assert cache.last_cached == 32
    assert hit[0] == miss[0] and torch.equal(hit[1], miss[1])


@pytest.mark.parametrize("rows", [True, False], ids=["any-length", "boundaries"])
@pytest.mark.parametrize(("policy", "kw"), POLICIES, ids=[p for p, _ in POLICIES])
def test_a_hit_inside_a_batch_changes_nothing(ckpt, policy, kw, rows) -> None:
    """Two conversations' second turns join a batch beside random co-runners, at random
    steps after their first turns, under copy delays: each resumes from its first turn's
    cached state and every sequence's tokens and logits are its solo run's (no cache)."""
    model = _load(ckpt, policy, **kw)
    model.set_row_invariant(rows)
    rng = random.Random(11)
    other = [rng.randrange(64) for _ in range(20)]
    first = [FIRST[0].tolist(), other]
    second = [SECOND[0].tolist(), other + [rng.randrange(64) for _ in range(9)]]
    co = [[rng.randrange(64) for _ in range(rng.randint(1, 14))] for _ in range(3)]
    co[2] = first[0][:19] + co[2]  # shares 19 tokens with the first conversation
    prompts = [first[0], co[0], first[1], co[1], second[0], co[2], second[1]]
    at = sorted(rng.randint(0, 8) for _ in range(4))
    joins = [0, at[0], at[1], at[1], at[2] + 1, at[2] + 1, at[3] + 2]  # turn 2 after turn 1
    cache = PromptCache(1 << 26)
    model.runtime.store.set_copy_delay(2000, seed=3)
    cached: list[int] = []
    toks, logits, _ = batched(model, prompts, NEW, joins, prompt_cache=cache, cached=cached)
    model.runtime.store.set_copy_delay(0)
    # A second turn resumes from its first turn's end (row-invariant), else its last
    # boundary before that end; any prompt (co[2] above) where it parts from one prefilled
    # before it (in join order), else (boundaries) at the last boundary before that.
    ends = [len(f) if rows else (len(f) - 1) // CHUNK * CHUNK for f in first]

    def resumes(p: list[int], q: list[int]) -> int:  # from q's entries (kept before p's)
        n = min(shared_prefix(p, q), len(p) - 1)
        return n if rows else min(n, len(q) - 1) // CHUNK * CHUNK

    want = [max((resumes(p, q) for q in prompts[:j]), default=0) for j, p in enumerate(prompts)]
    assert (want[4], want[6], want[5]) == (ends[0], ends[1], 19 if rows else 16)
    assert cached == want
    for j, p in enumerate(prompts):
        want = solo(model, p, NEW)
        assert toks[j] == want[0], f"prompt {j}"
        assert torch.equal(logits[j].float(), want[1]), f"prompt {j}"
    # one cache for both paths: a solo request resumes from a batch's entries
    third = torch.tensor([[*second[1], 1, 2, 3]])
    miss = _gen(model, third)
    hit = _gen(model, third, cache)
    assert cache.last_cached == (len(second[1]) if rows else 24)
    assert hit[0] == miss[0] and torch.equal(hit[1], miss[1])


def test_a_hit_inside_a_batch_on_the_slab_path(ckpt) -> None:
    """Prefill staged through the shared slab (CUDA's path, forced on the CPU), a batch
    entry resumed by a later newcomer: its tokens and logits are its solo run's."""
    model = _load(ckpt, "psr", lam=0.3, n=1)
    model.runtime.prefill_reads = "slab"
    prompts = [FIRST[0].tolist(), [3, 1, 4, 1, 5], SECOND[0].tolist()]
    cache = PromptCache(1 << 26)
    model.runtime.store.set_copy_delay(3000, seed=5)
    cached: list[int] = []
    toks, logits, _ = batched(model, prompts, NEW, [0, 1, 2], prompt_cache=cache, cached=cached)
    model.runtime.store.set_copy_delay(0)
    assert cached == [0, 0, FIRST.shape[1]]
    for j, p in enumerate(prompts):
        want = solo(model, p, NEW)
        assert toks[j] == want[0] and torch.equal(logits[j].float(), want[1]), f"prompt {j}"


def test_a_packed_kv_format_budget_counts_its_packed_bytes(ckpt) -> None:
    """kv_format='int8': a chunk's KV is its int8 values and fp32 scales, the bytes the
    cache's tensors take (what the memory plan counts), not the compute dtype's."""
    model = psr.load(ckpt, "exact", 0.5, progress=False, kv_format="int8")
    model.set_prefill_chunk(CHUNK)
    cache = PromptCache(1 << 26)
    model.generate(FIRST[:, : CHUNK + 1], max_new_tokens=1, prompt_cache=cache)
    at, entry = cache.lookup(model._prefill_key(False), FIRST[0, : CHUNK + 1])
    assert at == CHUNK and entry is not None
    packed = entry.nbytes - sum(h.nbytes for h in entry.histories)  # the KV tensors' bytes
    itemsize = next(model.hf.parameters()).element_size()
    assert packed == kv_bytes(model.config, itemsize, CHUNK, "int8")
    assert packed < kv_bytes(model.config, itemsize, CHUNK) // 2  # the float count: 4x
    model.generate(FIRST, max_new_tokens=1, prompt_cache=PromptCache(packed))
    with pytest.raises(ValueError, match=f"below one prefill chunk's KV .*{packed} bytes"):
        model.generate(FIRST, max_new_tokens=1, prompt_cache=PromptCache(packed - 1))


def test_a_hit_in_a_batch_counts_its_tokens_in_the_kv_budget(ckpt) -> None:
    """A resumed prefix enters the KV cache with the newcomer's first chunk: it waits
    while the cached tokens and that chunk do not fit beside the others' KV."""
    model = _load(ckpt, "psr", lam=0.3, n=1)
    cache = PromptCache(1 << 26)
    dec = BatchDecoder(model, 2, kv_tokens=70, prompt_cache=cache)
    a = dec.add(FIRST)
    (logits,) = dec.ready().values()
    b = dec.add(SECOND)
    dec.feed({a: int(logits.argmax())})  # a holds 41; b's 40 cached + 8 would make 89
    assert dec.kv_held == 41 and dec.cached_tokens(b) == 0
    dec.remove(a)
    assert list(dec.ready()) == [b]
    assert dec.cached_tokens(b) == FIRST.shape[1] and dec.kv_held == SECOND.shape[1]
    computed = FIRST.shape[1] + (SECOND.shape[1] - FIRST.shape[1])  # a's, then b's rest
    assert dec.stats["prefill_tokens"] == computed


def test_generate_batch_takes_the_prompt_cache(ckpt) -> None:
    """The second prompt's prefill begins after the first's (oldest first): it resumes
    from the first's end, and both answer as `generate` alone does."""
    model = _load(ckpt, "psr", lam=0.3, n=1)
    cache = PromptCache(1 << 26)
    got = model.generate_batch([FIRST[0], SECOND[0]], NEW, prompt_cache=cache)
    assert cache.hits == 1 and cache.cached_tokens == FIRST.shape[1]
    for ids, g in zip((FIRST, SECOND), got, strict=True):
        assert g == model.generate(ids, max_new_tokens=NEW)[0, ids.shape[1] :].tolist()
