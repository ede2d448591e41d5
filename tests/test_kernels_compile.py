"""Compile every kernel variant for real GPU targets, without a GPU.

The interpreter runs the kernels' logic but not Triton's GPU compiler, which rejects
things the interpreter accepts (types, layouts, shapes). Triton ships ptxas, so the
launch configurations the wrappers choose for real model shapes are compiled here to
sm_80 and sm_90 cubins, in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import itertools
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from psr_kernels.expert_ffn import _down_kernel, _gate_up_kernel, ffn_launch_config
    from psr_kernels.routing import _route_kernel, route_launch_config

    def compile_(fn, types, consts, warps, arch):
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        assert k.asm["cubin"], fn.__name__

    p = lambda t: "*" + t
    n = 0
    # (E, k, H, F): OLMoE-1B-7B, Qwen3-30B-A3B, DeepSeek-V3-like (group-limited sigmoid)
    shapes = [(64, 8, 2048, 1024, 0), (128, 8, 2048, 768, 0), (256, 8, 7168, 2048, 2)]
    # Decode (T = 1) for every mode; a prefill-sized batch for routing from logits.
    modes = [(0, 1), (0, 16), (1, 1), (2, 1)]
    for arch, (E, k, H, F, scoring), (mode, T) in itertools.product((80, 90), shapes, modes):
        cfg = route_launch_config(mode, T, E, H, k)
        warps = cfg.pop("num_warps")
        types = {"in_ptr": p("bf16"), "gw_ptr": p("bf16"), "nw_ptr": p("bf16"), "eps": "fp32",
                 "mask_ptr": p("u8"), "bias_ptr": p("fp32"), "w_out": p("fp32"),
                 "ids_out": p("i64"), "logits_out": p("fp32"), "incache_out": p("u8"),
                 "lam": "fp32", "scaling": "fp32"}
        grouped = scoring == 2
        consts = dict(K=k, MODE=mode, SCORING=scoring, RENORM=True, HAS_MASK=True,
                      HAS_BIAS=grouped, STORE_INCACHE=mode == 2, N_GROUP=8 if grouped else 1,
                      TOPK_GROUP=4 if grouped else 1, NG_P2=8 if grouped else 2, **cfg)
        compile_(_route_kernel, types, consts, warps, arch)
        n += 1
    for arch, (E, k, H, F, _) in itertools.product((80, 90), shapes):
        c1, c2 = ffn_launch_config(1, H, F)
        w1, w2 = c1.pop("num_warps"), c2.pop("num_warps")
        compile_(_gate_up_kernel, {"x_ptr": p("bf16"), "slab_ptr": p("bf16"),
                                   "slots_ptr": p("i64"), "h_ptr": p("fp32")},
                 dict(K=k, **c1), w1, arch)
        compile_(_down_kernel, {"h_ptr": p("fp32"), "slab_ptr": p("bf16"), "slots_ptr": p("i64"),
                                "w_ptr": p("fp32"), "y_ptr": p("bf16")}, dict(K=k, **c2), w2, arch)
        n += 2
    print("compiled", n)
    """
)


@pytest.mark.slow
def test_kernels_compile_for_sm80_and_sm90(tmp_path) -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "compiled 36" in r.stdout
