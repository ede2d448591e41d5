"""Q4_K rows in tiles of 8 (Q4_K_X8: csrc/cpu/expert_gemv.h's tile_q4k) in the dense linear
and the expert FFN: every ISA path gives the scalar reference's bits, every output row is
the same whatever T, the co-rows and the thread count, the tiles compute what the rows
compute (the q8 path's row kernel, fp32 sums in another order; the f32 path untiles them:
the rows' bits) and what gguf-py's dequantized weights give; C++ and torch tile alike; a
layer's plan takes the tiles where they are on and makes them again when its weight is
written; bad input gets one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ggml_blocks import expert_rows, gguf_dequant, random_blocks

import psr._C as _C
import psr_kernels as pk
from psr import store
from psr.store import cpu_kernels as ck
from psr_kernels import ggml

ISAS = store.cpu_isas()
Q4_K, Q4_K_X8, GGML_FMT = 12, 201, 6
# (N, K): one tile, a K of one super-block, odd tile counts, a long row.
SHAPES = [(8, 256), (24, 512), (72, 768), (16, 2048)]


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(random_blocks("Q4_K", n, k, rng).copy()).reshape(n, -1)


def _call(x: torch.Tensor, w: torch.Tensor, k: int, tile: int, isa: str = "auto",
          threads: int = 1, dot: str = "q8",
          bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """cpu_linear's kernel on w as it is (Q4_K rows, or Q4_K_X8 tiles with tile = 8)."""
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.shape[0])
    b = 0 if bias is None else bias.data_ptr()
    _C.cpu_linear(
        x.data_ptr(), x.shape[0], k, w.data_ptr(), w.shape[0], w.stride(0), GGML_FMT,
        Q4_K_X8 if tile == 8 else Q4_K, b, y.data_ptr(), threads, isa, dot,
    )  # fmt: skip
    return y


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_tiles_equal_on_every_path_and_for_any_rows(n: int, k: int) -> None:
    w = _weight(n, k, n + k)
    tiles = ck.tile_q4k(w, k)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(k))
    bias = torch.randn(n)
    want = _call(x, tiles, k, 8, "scalar", bias=bias)
    for isa in ISAS:
        for threads in sorted({1, min(2, store.cpu_max_threads())}):
            got = _call(x, tiles, k, 8, isa, threads, bias=bias)
            assert torch.equal(got, want), (isa, threads)
    for t in range(7):  # a row alone, and among others in another order
        assert torch.equal(_call(x[t : t + 1], tiles, k, 8, bias=bias), want[t : t + 1])
    perm = torch.tensor([3, 0, 6])
    assert torch.equal(_call(x[perm], tiles, k, 8, bias=bias), want[perm])
    assert torch.equal(_call(x, tiles, k, 8, dot="q8_madd", bias=bias), want)
    # the fp32 dot untiles them: the rows' bits
    rows32 = _call(x, w, k, 1, dot="f32", bias=bias)
    assert torch.equal(_call(x, tiles, k, 8, dot="f32", bias=bias), rows32)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_tiles_compute_what_the_rows_compute(n: int, k: int) -> None:
    w = _weight(n, k, 3 * n + k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(n))
    rows = _call(x, w, k, 1, "scalar")  # the q8 path's row kernel: the same integer sums
    tiles = _call(x, ck.tile_q4k(w, k), k, 8)
    deq = gguf_dequant(w.numpy(), "Q4_K", (n, k))
    scale = (x.abs() @ deq.abs().T).max()
    torch.testing.assert_close(tiles, rows, rtol=0, atol=float(scale) * 1e-6)
    # and the fp32 product within the activations' 8-bit rounding
    torch.testing.assert_close(tiles, x @ deq.T, rtol=0, atol=float(scale) * 2e-2)
    # a wrong permutation mixes rows: far beyond that
    assert (tiles - x @ deq.T).abs().max() < 0.1 * (x @ deq.T).abs().max()


def test_tile_q4k_only_permutes_bytes_as_the_torch_reference_does() -> None:
    w = _weight(16, 512, 5)
    t = ck.tile_q4k(w, 512)
    assert t.shape == w.shape and t.dtype == torch.uint8
    assert torch.equal(t, ggml.tile_q4_k(w, 512))
    assert torch.equal(ggml.untile_q4_k(t, 512), w)
    assert not torch.equal(t, w)
    # tiles are independent: the second tile is the second 8 rows' alone
    assert torch.equal(t[8:], ck.tile_q4k(w[8:].clone(), 512))
    # the reference dequantizer reads tiles as their rows
    assert torch.equal(
        pk.dequantize_ggml(t, "Q4_K_X8", (16, 512)), pk.dequantize_ggml(w, "Q4_K", (16, 512))
    )


def test_row_formats_tile_the_parts_that_fill_tiles() -> None:
    f = pk.RowFormat.parse("gguf:Q4_K,Q4_K,Q6_K")
    t = f.tiled(2048, 1024)
    assert t == pk.RowFormat.parse("gguf:Q4_K_X8,Q4_K_X8,Q6_K") and t.has_tiles
    assert t.untiled() == f and not f.has_tiles
    assert f.tiled(2048, 1028) == f  # gate / up of 1028 rows fill no tiles
    mixed = pk.RowFormat.parse("gguf:Q4_K,Q4_K,Q4_K").tiled(12, 16)
    assert mixed.shown == "Q4_K_X8,Q4_K_X8,Q4_K"
    assert t.layout(2048, 1024).nbytes == f.layout(2048, 1024).nbytes
    assert "Q4_K_X8" not in pk.BLOCK_TYPES  # the Triton kernels' types
    with pytest.raises(ValueError, match="CPU kernels' tiles; the Triton kernels take gguf:Q4_K"):
        _ = pk.GGMLLayout.of(t, 2048, 1024).triton_type_ids


def _tile_row(row: torch.Tensor, types: tuple[str, str, str], H: int, F: int) -> torch.Tensor:
    """One packed expert row with its Q4_K parts tiled in place."""
    lay = pk.GGMLLayout.of(pk.RowFormat.blocks(*types), H, F)
    out = row.clone()
    for off, n, (r, k), t in zip(
        (lay.gate, lay.up, lay.down), lay.part_bytes, ((F, H), (F, H), (H, F)), types,
        strict=True,
    ):  # fmt: skip
        if t == "Q4_K":
            out[off : off + n] = ck.tile_q4k(row[off : off + n].view(r, -1), k).reshape(-1)
    return out


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q4_K", "Q4_K"),
                                   ("Q6_K", "Q4_K", "Q4_K")])  # fmt: skip
def test_the_expert_ffn_on_tiles(types: tuple[str, str, str]) -> None:
    H, F, E, k = 256, 512, 4, 2
    rng = np.random.default_rng(7)
    rows = [expert_rows(types, H, F, rng)[0] for _ in range(E)]
    slab = torch.stack(rows)
    fmt = pk.RowFormat.blocks(*types)
    tfmt = fmt.tiled(H, F)
    tslab = torch.stack([_tile_row(r, types, H, F) for r in rows])
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([[0, 3], [1, 2], [3, 3], [2, 0], [1, 1]])
    w = torch.rand(5, k, generator=torch.Generator().manual_seed(2))

    def ffn(s: torch.Tensor, f: pk.RowFormat, xs: torch.Tensor, sl: torch.Tensor,
            ws: torch.Tensor, **kw: object) -> torch.Tensor:  # fmt: skip
        return ck.cpu_expert_ffn(xs, s, sl, ws, H, F, fmt=f, threads=kw.pop("threads", 1), **kw)

    want = ffn(tslab, tfmt, x, slots, w, dot="q8")
    every = all(t.tile_rows > 1 for t in tfmt.block_types)  # no part's row kernel per path
    for isa in ISAS:
        mine = want if every else ffn(tslab, tfmt, x, slots, w, isa=isa, dot="q8")
        for threads in sorted({1, min(2, store.cpu_max_threads())}):
            assert torch.equal(ffn(tslab, tfmt, x, slots, w, isa=isa, dot="q8", threads=threads),
                               mine), (isa, threads)  # fmt: skip
    for t in range(5):  # a token alone: its bits in the batch
        one = ffn(tslab, tfmt, x[t : t + 1], slots[t : t + 1], w[t : t + 1], dot="q8")
        assert torch.equal(one, want[t : t + 1])
    rows_q8 = ffn(slab, fmt, x, slots, w, dot="q8")
    scale = float(rows_q8.abs().max())
    torch.testing.assert_close(want, rows_q8, rtol=0, atol=scale * 1e-5)
    # the fp32 dot untiles: the rows' bits
    f32 = ffn(slab, fmt, x, slots, w, dot="f32")
    assert torch.equal(ffn(tslab, tfmt, x, slots, w, dot="f32"), f32)
    # the reference (dequantized tiles) agrees within the q8 rounding
    ref = pk.expert_ffn_ref(x, tslab, slots, w, H, F, fmt=tfmt)
    torch.testing.assert_close(want, ref, rtol=0, atol=scale * 3e-2)


@pytest.mark.parametrize("on", ["1", "0"])
def test_a_plan_takes_the_tiles_and_remakes_them_after_a_write(
    on: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ck.CPU_TILES_ENV, on)
    ck.cpu_tiles_on.cache_clear()
    n, k = 24, 512
    w = _weight(n, k, 11)
    x = torch.randn(3, k)
    plan = ck.LinearPlan(w, ggml_type=Q4_K, in_features=k)
    tiled = ck.cpu_tiles_on()
    want = _call(x, ck.tile_q4k(w, k), k, 8) if tiled else _call(x, w, k, 1)
    assert torch.equal(plan(x, threads=1, dot="q8"), want)
    # the fp32 dot has no tiles: the rows, as before
    assert torch.equal(plan(x, threads=1, dot="f32"), _call(x, w, k, 1, dot="f32"))
    if tiled:
        w[:8] = _weight(8, k, 12)  # written in place: the tiles are made again
        assert torch.equal(plan(x, threads=1, dot="q8"), _call(x, ck.tile_q4k(w, k), k, 8))
    monkeypatch.delenv(ck.CPU_TILES_ENV)
    ck.cpu_tiles_on.cache_clear()


def test_tiles_on_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in (
        ("0", False),
        ("1", True),
        ("auto", ISAS[-1] == "avx2"),
        ("", ISAS[-1] == "avx2"),
    ):
        monkeypatch.setenv(ck.CPU_TILES_ENV, raw)
        ck.cpu_tiles_on.cache_clear()
        assert ck.cpu_tiles_on() == want
    monkeypatch.setenv(ck.CPU_TILES_ENV, "yes")
    ck.cpu_tiles_on.cache_clear()
    with pytest.raises(ValueError, match="PSR_CPU_TILES='yes': expected auto, 1 or 0"):
        ck.cpu_tiles_on()
    monkeypatch.delenv(ck.CPU_TILES_ENV)
    ck.cpu_tiles_on.cache_clear()


def test_bad_tiles_are_one_line_errors() -> None:
    w = _weight(16, 256, 1)
    t = ck.tile_q4k(w, 256)
    x = torch.randn(1, 256)
    with pytest.raises(ValueError, match="a multiple of 8 and contiguous rows, got 12"):
        _call(x, t[:12].contiguous(), 256, 8)
    with pytest.raises(ValueError, match="a multiple of 8 and K of 256, got 12 x 256"):
        ck.tile_q4k(w[:12], 256)
    with pytest.raises(ValueError, match="tiles of 8; \\[12, 256\\] does not"):
        pk.dequantize_ggml(t[:12].contiguous(), "Q4_K_X8", (12, 256))
