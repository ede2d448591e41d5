"""The memory plan (psr.models.memory_plan) against totals worked out by hand: a tiny GGUF
file (qwen3_moe, Q8_0 dense, Q4_K experts) and a tiny safetensors model; its verdicts and
one-line refusals, `psr inspect --gpu-memory` (table and --json), bad sizes, and
`psr.load(gpu_memory=...)` choosing the slots and refusing before any weight is copied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_files import fit_table, gguf_tiny_model, write_gguf
from tiny_models import tiny_config, tiny_model

import psr
import psr.models.loader as loader
from psr.cli import main
from psr.models.memory_plan import CUDA_RESERVE, Budget, MemoryPlanError, Rates, fmt_bytes

# The tiny file, by hand: hidden 256, vocab 2112, 2 layers (both sparse), 4 experts,
# top-2, 4 heads of 64, 2 KV heads, expert FFN 256, intermediate_size 768, 256 positions.
# Dense elements: token_embd and output 256 x 2112 each; per layer q, o 256 x 256, k, v
# 128 x 256, the router 4 x 256 (all Q8_0: 34 bytes per 32 values), q/k norms 64 each and
# two norms of 256 (F32); output_norm 256 (F32). Natively the matrices stay in their
# blocks but the routers, which become float32 (psr.models.dense_bytes' rule).
ROUTERS = 2 * 4 * 256
Q8 = 2 * 256 * 2112 + 2 * (2 * 256 * 256 + 2 * 128 * 256) + ROUTERS
F32 = 2 * (2 * 64 + 2 * 256) + 256
DENSE = {"native": (Q8 - ROUTERS) // 32 * 34 + (F32 + ROUTERS) * 4, "float": (Q8 + F32) * 4}
ROW = 3 * (256 * 256 // 256 * 144)  # gate, up, down in Q4_K: 144 bytes per 256 values
SLOT = 2 * ROW  # one slot in each of the two sparse layers
KV = 2 * (2 * 2 * 64) * 4  # bytes a token: 2 layers x keys and values of 2 heads x 64
CTX = 256
# workspace: a 256-token chunk x (logits in float32 twice + 16 hidden vectors + 3 x 768)
WS = 256 * (2112 * 8 + (16 * 256 + 3 * 768) * 4)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "q.gguf"
    write_gguf(gguf_tiny_model("qwen3_moe"), path, {"experts": "Q4_K", "dense": "Q8_0"})
    return path


def _plan(path: Path, **budget: object) -> psr.models.memory_plan.MemoryPlan:
    """The plan under `budget` (the dense part in the file's own blocks unless told)."""
    budget.setdefault("dense_format", "native")
    plan = psr.inspect(path, Budget(**budget)).plan  # type: ignore[arg-type]
    assert plan is not None
    return plan


def test_the_gguf_plan_is_the_sum_worked_out_by_hand(tiny_gguf: Path) -> None:
    fixed = DENSE["native"] + CTX * KV + WS + CUDA_RESERVE
    p = _plan(tiny_gguf, gpu_memory=fixed + 3 * SLOT + 1000, context=CTX)
    assert (p.dense, sum(p.kv.values()), p.kv, p.workspace) == (
        DENSE["native"], CTX * KV, {"full_attention": CTX * KV}, WS + CUDA_RESERVE,
    )  # fmt: skip
    assert (p.slot_bytes, p.slots, p.slab, p.residency) == (SLOT, 3, 3 * SLOT, 0.75)
    assert p.fits and p.device_total == fixed + 3 * SLOT
    assert p.host_rows == 4 * SLOT and p.pageable == 0  # no host budget: every row held
    # every expert fits: the slab stops at 4 of 4
    assert _plan(tiny_gguf, gpu_memory=2**40, context=CTX).slots == 4
    # the dense part dequantized to float32, and the KV cache at the model's 256 positions
    f = _plan(tiny_gguf, gpu_memory=2**40, dense_format="float")
    assert (f.dense, f.context, sum(f.kv.values())) == (DENSE["float"], 256, 256 * KV)


def test_a_model_that_cannot_fit_is_refused_with_the_shortfall(tiny_gguf: Path) -> None:
    """top_k slots on the device do not fit by 100 KiB; experts_on='cpu' needs none and
    takes the one slot that fits."""
    gpu = DENSE["native"] + CTX * KV + WS + CUDA_RESERVE + 2 * SLOT - 100 * 2**10
    p = _plan(tiny_gguf, gpu_memory=gpu, context=CTX)
    assert not p.fits and p.slots == 2
    assert p.shortfall == [
        f"device memory {gpu / 2**20:.2f} MiB is short by 100.0 KiB (dense part 1.51 MiB + "
        "KV cache 512.0 KiB + workspace 522.38 MiB + slab of 2 slots 432.0 KiB = "
        f"{(gpu + 100 * 2**10) / 2**20:.2f} MiB; over from the slab of 2 slots)"
    ]
    assert p.advice[:2] == [
        f"gpu_memory >= {(gpu + 100 * 2**10) / 2**20:.2f} MiB",
        "experts_on='cpu' or 'hybrid' (no slot needed: -432.0 KiB)",
    ]
    # bf16 halves the KV cache and the workspace's float32-sized parts (logits, activations)
    half = CTX * KV // 2 + 256 * (2112 * 2 + (16 * 256 + 3 * 768) * 2)
    assert f"dtype='bfloat16' (-{half / 2**20:.2f} MiB)" in p.advice
    with pytest.raises(MemoryPlanError) as e:
        p.check("m.gguf")
    assert str(e.value) == "m.gguf: " + p.message() and "\n" not in str(e.value)
    assert p.message().startswith("does not fit: device memory")
    cpu = _plan(tiny_gguf, gpu_memory=gpu, context=CTX, experts_on="cpu")
    assert cpu.fits and cpu.slots == 1  # a slab smaller than top_k
    # fewer slots than asked, and a float dense part that native would fit
    asked = _plan(tiny_gguf, gpu_memory=gpu + 2 * SLOT, context=CTX, slots=4)
    assert not asked.fits and "slots <= 3" in asked.advice
    fl = _plan(tiny_gguf, gpu_memory=gpu + 2 * SLOT, context=CTX, dense_format="float")
    saved = (DENSE["float"] - DENSE["native"]) / 2**20
    assert not fl.fits and f"dense_format='native' (-{saved:.2f} MiB)" in fl.advice


def test_host_rows_page_from_the_file_or_are_refused_where_they_cannot(
    tiny_gguf: Path,
) -> None:
    """A host budget of 5 rows holds 5 of the 8 (layer-balanced: experts 0-1 of both layers,
    expert 2 of layer 0); the rest page from the GGUF file with experts_on='gpu', and
    experts_on='cpu' (which reads every row in place) is refused, naming the shortfall."""
    budget = dict(gpu_memory=2**40, host_memory=5 * ROW, context=CTX)
    gpu = _plan(tiny_gguf, **budget)
    assert gpu.fits and (gpu.host_rows, gpu.pageable) == (5 * ROW, 3 * ROW)
    cpu = _plan(tiny_gguf, **budget, experts_on="cpu")
    assert cpu.shortfall == [
        "host memory 540.0 KiB is short by 324.0 KiB (every expert row 864.0 KiB; "
        "experts_on='cpu' reads them in place)"
    ]
    assert cpu.advice == [
        "host_memory >= 864.0 KiB",
        "experts_on='gpu' (rows beyond the budget stay in the file)",
    ]


def test_kv_formats_are_counted_and_bad_budgets_refused(tiny_gguf: Path) -> None:
    """bf16: two bytes a value; fp8 / int8: a byte a value and an fp32 scale per (token,
    head) of keys and of values (each layer's 256 values a token are 4 rows of 64); a
    recurrent state has none of them."""
    got = {f: _plan(tiny_gguf, gpu_memory=2**40, context=CTX, kv_format=f) for f in KV_BYTES}
    assert {f: sum(p.kv.values()) for f, p in got.items()} == KV_BYTES
    from psr.runtime.kv import kv_bytes

    nxt = tiny_config("qwen3_next")
    with pytest.raises(ValueError, match=r"^kv_format='int8': the linear_attention layers"):
        kv_bytes(nxt, 4, 16, "int8")
    with pytest.raises(ValueError, match=r"^slots=1 must be in \[2, 4\] with experts_on='gpu'"):
        _plan(tiny_gguf, gpu_memory=2**40, slots=1)
    bad = r"^kv_format must be one of auto, bf16, int8, fp8, fit; got 'q4'"
    with pytest.raises(ValueError, match=bad):
        Budget(gpu_memory=1, kv_format="q4")


KV_BYTES = {
    "auto": CTX * KV,
    "bf16": CTX * 2 * 256 * 2,
    "fp8": CTX * 2 * (256 + 4 * 4),
    "int8": CTX * 2 * (256 + 4 * 4),
}


def test_the_safetensors_plan_is_the_sum_worked_out_by_hand(tmp_path: Path) -> None:
    """A folder (config.json alone): the dense part is every parameter but the routed
    experts in the model dtype (as stored: native = float), a slot is gate, up and down of
    H x F floats in every sparse layer."""
    cfg = tiny_config("qwen3_moe")
    cfg.save_pretrained(tmp_path)
    model = tiny_model("qwen3_moe")
    experts = {id(p) for n, p in model.named_parameters() if ".experts." in n}
    dense = sum(p.numel() * 4 for p in model.parameters() if id(p) not in experts)
    H, F, L = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_hidden_layers
    slot = L * 3 * H * F * 4
    kv = L * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * 100
    ws = 100 * (cfg.vocab_size * 8 + (16 * H + 3 * cfg.intermediate_size) * 4) + CUDA_RESERVE
    p = _plan(tmp_path, gpu_memory=dense + kv + ws + 5 * slot + slot // 2, context=100)
    assert (p.dense, sum(p.kv.values()), p.workspace, p.slot_bytes) == (dense, kv, ws, slot)
    assert p.slots == 5 and p.fits
    both = {f: _plan(tmp_path, gpu_memory=2**40, dense_format=f).dense for f in DENSE}
    assert both == {"native": dense, "float": dense}


# --- psr inspect ------------------------------------------------------------------------


def test_psr_inspect_prints_the_plan_and_its_json(tiny_gguf: Path, capsys) -> None:
    args = ["inspect", "--model", str(tiny_gguf), "--ctx-size", "256", "--gpu-memory"]
    assert main([*args, "1GiB", "--json"]) == 0
    args[-1:-1] = ["--dense-format", "native"]
    js = json.loads(capsys.readouterr().out)["plan"]
    assert (js["fits"], js["slots"], js["dense"], js["slab"]) == (
        True,
        4,
        DENSE["native"],  # the default: what psr.load does (LoadConfig's dense_format)
        4 * ROW * 2,
    )
    assert js["kv"] == {"full_attention": CTX * KV} and js["device_total"] <= 2**30
    small = DENSE["native"] + CTX * KV + WS + CUDA_RESERVE + SLOT  # one slot: below top_k
    assert main([*args, str(small), "--host-memory", "1MiB"]) == 1
    out = capsys.readouterr().out
    assert "expert slab: 2/4 per layer (residency 0.5, top_k 2)" in out
    assert "  verdict    does not fit: device memory" in out
    assert main([*args, str(small), "--experts-on", "cpu"]) == 0
    assert "verdict    fits: 1 of 4 experts per layer" in capsys.readouterr().out


# rates chosen so each term is easy to follow: 1 GB/s of device memory, 0.5 GB/s of host
# link (+ 5 µs a copy), 0.25 GB/s of CPU expert kernels (+ 1 µs an expert, 15 µs a layer)
RATES = Rates("test", 1.0, 0.5, 5.0, 0.25, 15.0, 1.0)


# ids not "gpu": conftest skips tests with a "gpu" keyword where no CUDA device is
@pytest.mark.parametrize(
    "experts_on", ["gpu", "cpu", "hybrid", "hybrid:0"], ids=["copied", "cpu", "hybrid", "cap0"]
)
def test_the_modeled_decode_time_worked_out_by_hand(tiny_gguf: Path, experts_on: str) -> None:
    """3 of 4 slots: k (1 - C/E) = 2 (1 - 3/4) = 0.5 of the two routed experts miss per
    layer. Both layers: 1.5 hits read on the device; 'cpu' computes the half miss on the
    CPU beside them (hand-off + a call + half a row at CPU rate), 'gpu' copies it beside
    them then reads it on the device; 'hybrid' takes the faster ('hybrid:0' may copy
    none). Plus the dense part and the KV cache read once."""
    fixed = DENSE["native"] + CTX * KV + WS + CUDA_RESERVE
    none = _plan(tiny_gguf, gpu_memory=fixed + 3 * SLOT, context=CTX, experts_on=experts_on)
    assert none.modeled is None  # no rates, no modeled time
    p = _plan(
        tiny_gguf, gpu_memory=fixed + 3 * SLOT, context=CTX, experts_on=experts_on, rates=RATES
    )
    assert p.slots == 3 and p.modeled is not None
    hits = 1.5 * ROW / 1e9
    cpu = max(hits, 15e-6 + 0.5 * (ROW / 0.25e9 + 1e-6))
    gpu = max(hits, 0.5 * (ROW / 0.5e9 + 5e-6)) + 0.5 * ROW / 1e9
    layer = {"cpu": cpu, "gpu": gpu, "hybrid": min(cpu, gpu), "hybrid:0": cpu}[experts_on]
    dense, kv = DENSE["native"] / 1e9, CTX * KV / 1e9
    want = dict(dense_ms=dense * 1e3, kv_ms=kv * 1e3, experts_ms=2 * layer * 1e3)
    for key, ms in want.items():
        assert p.modeled[key] == pytest.approx(ms, rel=1e-12), key
    assert p.modeled["ms_per_token"] == pytest.approx(sum(want.values()), rel=1e-12)
    assert (p.modeled["misses_per_layer"], p.modeled["rates"]) == (0.5, "test")
    assert "  modeled    " in p.table() and "ms/token decode on test" in p.table()
    # every expert on the device: no miss; a plan that does not fit has no modeled time
    full = _plan(tiny_gguf, gpu_memory=2**40, context=CTX, rates=RATES)
    assert full.modeled is not None and full.modeled["experts_ms"] == pytest.approx(
        2 * 2 * ROW / 1e9 * 1e3
    )
    assert _plan(tiny_gguf, gpu_memory=fixed, context=CTX, rates=RATES).modeled is None


def test_psr_inspect_prices_the_plan_with_a_profile(tiny_gguf: Path, capsys) -> None:
    """`psr inspect --gpu-memory` prints the modeled decode time on rtx4090's rates by
    default, `--profile h200` on the H200's; the JSON carries what the library computes."""
    from psr.eval.latency import get_profile

    args = ["inspect", "--model", str(tiny_gguf), "--ctx-size", "256", "--gpu-memory", "1GiB"]
    assert main(args) == 0
    assert "ms/token decode on rtx4090 (roofline:" in capsys.readouterr().out
    assert main([*args, "--profile", "h200", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["plan"]["modeled"]
    budget = Budget(2**30, context=256, rates=get_profile("h200").rates())
    want = psr.inspect(tiny_gguf, budget).plan
    assert want is not None and got == want.modeled and got["rates"] == "h200"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--gpu-memory", "24 gigs"], "argument --gpu-memory: '24 gigs' is not a size like 24GiB"),
        (["--gpu-memory", "1GiB", "--host-memory", "lots"], "argument --host-memory: 'lots'"),
        (["--gpu-memory", "1GiB", "--context", "0"], "'0' is not a token count like 32768"),
        (["--host-memory", "1GiB"], "--host-memory is part of the memory plan: give --gpu"),
        (["--kv-format", "fp8"], "--kv-format is part of the memory plan: give --gpu-memory"),
        (["--profile", "h200"], "--profile is part of the memory plan: give --gpu-memory"),
        (["--gpu-memory", "1GiB", "--profile", "x"], "--profile: unknown profile 'x'; built in"),
    ],
)
def test_bad_plan_flags_are_one_line_usage_errors(
    tiny_gguf: Path, capsys, argv: list[str], error: str
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["inspect", "--model", str(tiny_gguf), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert error in err and len(err.splitlines()) <= 2, err  # argparse adds its usage line


def test_context_takes_k() -> None:
    from psr.cli.args import context_tokens

    assert (context_tokens("32k"), context_tokens("8192")) == (32768, 8192)


# --- psr.load(gpu_memory=...) -------------------------------------------------------------


def test_kv_format_fit_picks_the_first_format_that_fits(tiny_gguf: Path) -> None:
    """kv_format 'fit': the KV cache in the model's dtype does not fit beside the top-k
    slots, int8 does: the plan picks int8 and says so, the load keeps int8 KV (the bytes
    the plan counted) and decodes; with room it is 'auto'; with none, the refusal names
    the smallest format's shortfall; without gpu_memory it is refused."""
    fixed = DENSE["native"] + WS  # the CPU backend: no CUDA reserve
    gpu = fixed + KV_BYTES["int8"] + 2 * SLOT + 1000
    assert fixed + CTX * KV + 2 * SLOT > gpu  # 'auto' is short
    p = _plan(tiny_gguf, gpu_memory=gpu, context=CTX, kv_format="fit", cuda=False)
    assert p.fits and (p.kv_format, sum(p.kv.values()), p.slots) == ("int8", KV_BYTES["int8"], 2)
    short = CTX * KV + fixed + 2 * SLOT - gpu
    assert p.chosen == f"kv_format 'fit' chose 'int8': 'auto' is short by {fmt_bytes(short)}"
    assert "chosen     kv_format 'fit' chose 'int8'" in p.table()
    roomy = _plan(tiny_gguf, gpu_memory=2**40, context=CTX, kv_format="fit", cuda=False)
    assert (roomy.kv_format, roomy.chosen) == ("auto", "kv_format 'fit' chose 'auto'")
    opts = dict(device="cpu", context=CTX, kv_format="fit", progress=False)
    with psr.load(tiny_gguf, gpu_memory=gpu, **opts) as m:
        assert m.hf.psr_kv_format == "int8"
        assert m.memory(CTX)["device_kv"] == KV_BYTES["int8"]
        assert len(m.generate([1, 2, 3], max_new_tokens=2)) >= 1
    with pytest.raises(
        MemoryPlanError, match=r"no format fits \(auto, int8, fp8 tried; fp8 shown\)$"
    ):
        psr.load(tiny_gguf, gpu_memory=fixed, **opts)
    with pytest.raises(ValueError, match=r"^kv_format='fit' needs gpu_memory"):
        psr.load(tiny_gguf, **opts)


def test_load_takes_the_slots_the_plan_fits(tiny_gguf: Path) -> None:
    """CPU backend (no CUDA reserve): the plan gives 3 slots; the loaded model holds what
    the plan counted (its dense part also holds the rotary buffers, 256 bytes)."""
    gpu = DENSE["native"] + CTX * KV + WS + 3 * SLOT + 1000
    with psr.load(tiny_gguf, device="cpu", gpu_memory=gpu, context=CTX, progress=False) as m:
        mem = m.memory(CTX)
        assert [L.num_slots for L in m.runtime.store.layers] == [3, 3]
        assert len(m.generate([1, 2, 3], max_new_tokens=2)) >= 1
    assert (mem["device_slab"], mem["device_kv"]) == (3 * SLOT, CTX * KV)
    assert 0 <= mem["device_dense"] - DENSE["native"] <= 1024


def test_load_refuses_before_copying_a_weight(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_copy(*a: object) -> None:
        raise AssertionError("a weight was copied before the plan refused")

    monkeypatch.setattr(loader, "_build_model", no_copy)
    gpu = DENSE["native"] + CTX * KV + WS + 2 * SLOT - 2**10
    opts = dict(device="cpu", gpu_memory=gpu, context=CTX, progress=False)
    with pytest.raises(MemoryPlanError) as e:
        psr.load(tiny_gguf, **opts)
    msg = str(e.value)
    assert msg.startswith(f"{tiny_gguf} with gpu_memory={gpu}: does not fit: device memory")
    assert "short by 1.0 KiB" in msg and "experts_on='cpu' or 'hybrid'" in msg
    with pytest.raises(MemoryPlanError, match=r"slab of 4 slots .* change: gpu_memory >= .*"):
        psr.load(tiny_gguf, residency=1.0, **opts)  # an asked residency is checked
    with pytest.raises(ValueError, match=r"^gpu_memory must be a size like '48GB'"):
        psr.load(tiny_gguf, gpu_memory="lots")


def test_load_with_experts_on_cpu_takes_a_slab_below_top_k(tiny_gguf: Path) -> None:
    gpu = DENSE["native"] + CTX * KV + WS + SLOT + 1000
    with psr.load(
        tiny_gguf, device="cpu", gpu_memory=gpu, context=CTX, experts_on="cpu", progress=False
    ) as m:
        assert [L.num_slots for L in m.runtime.store.layers] == [1, 1]
        assert len(m.generate([1, 2, 3], max_new_tokens=2)) >= 1


def test_deepseek_v3_plan_on_24_gb_from_its_published_header(tmp_path: Path) -> None:
    """DeepSeek-V3 Q4_K_M's header (bench/fit_table.py): the dense part in the file's own
    blocks is llama.cpp's `--cpu-moe` device part (every non-expert tensor in its type,
    from gguf-py's sizes; the router's correction bias apart), and on 24 GB at 32k tokens
    in bf16 the plan fits the slots left after it, the MLA latent cache (512 + 64 values a
    token and layer) and the workspace: fewer than top_k=8, so experts_on hybrid."""
    fit = fit_table()
    spec = fit.SPECS["DeepSeek-V3 Q4_K_M"]
    (path,) = fit.write(spec, tmp_path / "ds.gguf")
    table = fit.tensors(spec)
    llama = sum(fit.nbytes(sh, t) for n, sh, t in table if "_exps." not in n)
    bias = sum(fit.nbytes(sh, t) for n, sh, t in table if ".exp_probs_b." in n)
    experts = sum(fit.nbytes(sh, t) for n, sh, t in table if "_exps." in n)
    budget = Budget(24 * 10**9, context=32768, dense_format="native", dtype="bfloat16")
    p = _plan(path, **vars(budget) | {"experts_on": "hybrid"})
    assert p.dense == llama - bias
    assert sum(p.kv.values()) == 61 * 576 * 2 * 32768
    assert p.workspace == 512 * (129280 * 6 + (16 * 7168 + 3 * 18432) * 2) + CUDA_RESERVE
    assert p.slot_bytes == experts // 256
    free = 24 * 10**9 - p.dense - sum(p.kv.values()) - p.workspace
    assert p.fits and p.slots == free // p.slot_bytes < 8
    gpu = _plan(path, **vars(budget))  # experts_on gpu: top_k slots do not fit
    assert not gpu.fits and gpu.slots == 8
    assert "experts_on='cpu' or 'hybrid'" in gpu.message()


def test_load_of_a_safetensors_folder_plans_in_its_store_format(tmp_path: Path) -> None:
    """A float checkpoint quantized to int8 at load: a slot is the int8 rows, and rows
    converted at load cannot page from the file, so a host budget short of them is refused
    by the plan, before any weight is copied (CPU backend: the dense part and the slab are
    host memory too)."""
    from tiny_models import write_checkpoint

    import psr_kernels as pk

    cfg, model = tiny_config("qwen3_moe"), tiny_model("qwen3_moe")
    path = write_checkpoint(model, tmp_path / "m")
    H, F, L = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_hidden_layers
    row = pk.QuantLayout.of("int8", H, F, 128).nbytes
    experts = {id(p) for n, p in model.named_parameters() if ".experts." in n}
    dense = sum(p.numel() * 4 for p in model.parameters() if id(p) not in experts)
    opts = dict(device="cpu", expert_format="int8", context=64, progress=False)
    with psr.load(path, gpu_memory="1GiB", **opts) as m:  # type: ignore[arg-type]
        assert [x.num_slots for x in m.runtime.store.layers] == [8] * L  # every expert
        assert m.runtime.store.expert_bytes == [row] * L
    host = dense + 8 * L * row + 4 * row  # dense, slab, and 4 of the 8 x L rows
    short = (8 * L - 4) * row / 2**10
    with pytest.raises(MemoryPlanError, match=rf"is short by {short:.1f} KiB \(the dense part"):
        psr.load(path, gpu_memory="1GiB", host_memory=host, **opts)  # type: ignore[arg-type]
