"""Compile every kernel variant for real GPU targets, without a GPU.

The interpreter runs the kernels' logic but not Triton's GPU compiler, which rejects
things the interpreter accepts (types, layouts, shapes, constexpr logic). Triton ships
ptxas, so the launch configurations the wrappers choose for real model shapes
(`route_kernel_config`, `ffn_launch_config`, `quant_launch_config`, `linear_constexprs`:
the same functions the wrappers launch with) are compiled here to sm_80 and sm_90 cubins,
in a subprocess without TRITON_INTERPRET.
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
    from psr_kernels.quant import (
        FORMATS, QuantLayout, _fp8_decode_kernel, _quant_down_kernel, _quant_gate_up_kernel,
        quant_launch_config,
    )
    from psr_kernels.routing import RouteSpec, _route_kernel, route_kernel_config
    from psr_kernels.cache_state import CacheLayout, _cache_prefetch_kernel, _cache_use_kernel
    from psr_kernels.decode import _decode_kernel, decode_config
    from psr_kernels.ggml import (
        BLOCK_TYPES, GGMLLayout, _ggml_decode_kernel, _ggml_down_kernel, _ggml_gate_up_kernel,
        ggml_format, ggml_launch_config,
    )
    from psr_kernels.linear import NUM_WARPS, LinearFormat, _linear_kernel, linear_constexprs

    import concurrent.futures
    import importlib
    import os

    JOBS = []  # compiled at the end, one process per core (each compile is single-threaded)

    def build(job):
        module, name, types, consts, warps, arch = job
        fn = getattr(importlib.import_module(module), name)
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        assert k.asm["cubin"], name
        return name

    def compile_(fn, types, consts, warps, arch):
        JOBS.append((fn.fn.__module__, fn.fn.__name__, types, dict(consts), warps, arch))

    p = lambda t: "*" + t
    n = 0
    # (E, k, H, F, grouped): OLMoE-1B-7B, Qwen3-30B-A3B, DeepSeek-V3-like (group-limited sigmoid)
    shapes = [(64, 8, 2048, 1024, False), (128, 8, 2048, 768, False), (256, 8, 7168, 2048, True)]
    # What each wrapper launches: route at decode (T = 1) and for a prefill-sized batch,
    # route_hidden and predict_next at decode.
    ops = [("route", 1), ("route", 16), ("route_hidden", 1), ("predict_next", 1)]
    types = {"x_ptr": p("bf16"), "gate_ptr": p("bf16"), "norm_ptr": p("bf16"), "eps": "fp32",
             "mask_ptr": p("u8"), "bias_ptr": p("fp32"), "weights_ptr": p("fp32"),
             "ids_ptr": p("i64"), "logits_ptr": p("fp32"), "incache_ptr": p("u8"),
             "lam": "fp32", "scaling": "fp32", "norm_min": "fp32", "mixer_eps": "fp32",
             "gbias_ptr": p("bf16"), "subst_ptr": p("i32")}
    for arch, (E, k, H, F, grouped), (op, T) in itertools.product((80, 90), shapes, ops):
        group = dict(n_group=8, topk_group=4) if grouped else {}
        scoring = "sigmoid" if grouped else "softmax"
        if op == "predict_next":
            spec = RouteSpec(k, scoring=scoring, **group)
        else:
            spec = RouteSpec(k, 0.3, scoring, True, scaling=2.5 if grouped else 1.0, **group)
        cfg = dict(route_kernel_config(
            spec, num_tokens=T, num_experts=E, hidden_size=None if op == "route" else H,
            has_norm=op == "predict_next", has_mask=True, has_bias=grouped,
            store_logits=op == "route_hidden", store_incache=op == "predict_next",
            store_subst=op == "route",  # the host step's route_counted
        ))
        warps = cfg.pop("num_warps")
        compile_(_route_kernel, types, cfg, warps, arch)
        n += 1
    # The router kinds the family table added, once each (OLMoE's shape, decode): DeepSeek-V2's
    # group max, ERNIE's softmax + bias with its floor, PhiMoE's sparsemixer, Llama 4's
    # top-k sigmoid, gpt-oss's router bias in the fused GEMV.
    kinds = [
        (RouteSpec(8, 0.3, "softmax", n_group=8, topk_group=4, group_score="max"), {}),
        (RouteSpec(8, 0.3, "softmax", True, norm_min=1e-12), dict(has_bias=True)),
        (RouteSpec(2, 0.3, "sparsemixer", mixer_eps=0.01), {}),
        (RouteSpec(1, 0.3, "topk_sigmoid"), {}),
        (RouteSpec(4, 0.3, "topk_softmax"), dict(has_gate_bias=True)),
    ]
    for arch, (spec, kw) in itertools.product((90,), kinds):  # sm_80 shares the code paths
        gemv = kw.get("has_gate_bias", False)  # the router bias needs the fused GEMV
        cfg = dict(route_kernel_config(
            spec, num_tokens=1, num_experts=64, hidden_size=2048 if gemv else None,
            has_mask=True, store_logits=gemv, **kw,
        ))
        warps = cfg.pop("num_warps")
        compile_(_route_kernel, types, cfg, warps, arch)
        n += 1
    # The expert FFN reads slot ids (host step) or expert ids through the device slot map
    # (HAS_TABLE: the device step, its bf16 gate weights widened in-kernel).
    # Expert kinds: SwiGLU everywhere; gpt-oss's (clamped, biases) and Llama 4's (the
    # weight scales the input) at the first shape.
    swiglu = dict(ACT=0, HAS_BIAS=False, SCALE_INPUT=False)
    expert_kinds = [swiglu, dict(ACT=1, HAS_BIAS=True, SCALE_INPUT=False),
                    dict(ACT=0, HAS_BIAS=False, SCALE_INPUT=True)]
    ffn_types = {"bias_ptr": p("fp32"), "alpha": "fp32", "limit": "fp32"}
    cases = [(a, s, t, swiglu) for a in (80, 90) for s in shapes for t in (False, True)]
    cases += [(90, shapes[0], True, kind) for kind in expert_kinds[1:]]
    for arch, (E, k, H, F, _), table, kind in cases:
        c1, c2 = map(dict, ffn_launch_config(1, H, F))  # the cached mappings are read-only
        w1, w2 = c1.pop("num_warps"), c2.pop("num_warps")
        ids = {"slots_ptr": p("i64"), "table_ptr": p("i32")}
        w_ptr = {"w_ptr": p("bf16" if table else "fp32")}
        down_kind = {k2: v for k2, v in kind.items() if k2 != "ACT"}
        compile_(_gate_up_kernel, {"x_ptr": p("bf16"), "slab_ptr": p("bf16"),
                                   "h_ptr": p("fp32"), **ids, **ffn_types, **w_ptr},
                 dict(K=k, HAS_TABLE=table, **kind, **c1), w1, arch)
        compile_(_down_kernel, {"h_ptr": p("fp32"), "slab_ptr": p("bf16"), **ids,
                                **w_ptr, "y_ptr": p("bf16"), "part_ptr": p("fp32"),
                                **ffn_types},
                 dict(K=k, HAS_TABLE=table, **down_kind, **c2), w2, arch)
        n += 2
    # The device step: the fused decode kernel (with and without the next layer's
    # prediction, uncapped: experts_on gpu; and capped with it) and the standalone cache
    # kernels (capped and not), at half residency, n = 2.
    dtypes = {"logits_ptr": p("bf16"), "bias_ptr": p("fp32"), "weights_ptr": p("bf16"),
              "ids_ptr": p("i64"), "res_ptr": p("bf16"), "norm_ptr": p("bf16"), "eps": "fp32",
              "gate_ptr": p("bf16"), "next_bias_ptr": p("fp32"), "state_ptr": p("i32"),
              "lam": "fp32", "scaling": "fp32", "norm_min": "fp32", "mixer_eps": "fp32",
              "next_gbias_ptr": p("bf16")}
    variants = ((0, False), (2, False), (2, True))  # (n, capped)
    # sm_80 takes the two smaller shapes: DeepSeek's 256 experts compile the same code with
    # larger loops (54 s of one core for its three variants there) and are compiled for sm_90.
    for arch, (E, k, H, F, grouped), (pred, capped) in itertools.product(
        (80, 90), shapes, variants
    ):
        if arch == 80 and E == 256:
            continue
        group = dict(n_group=8, topk_group=4) if grouped else {}
        spec = RouteSpec(k, 0.3, "sigmoid" if grouped else "softmax", True, **group)
        layout = CacheLayout(E, E // 2, k, 2)
        cfg = dict(decode_config(spec, layout, H, n=pred, has_mask=True, has_bias=grouped,
                                 has_next_bias=grouped and pred > 0, capped=capped))
        warps = cfg.pop("num_warps")
        compile_(_decode_kernel, dtypes, cfg, warps, arch)
        lo = dict(layout.constexprs())
        compile_(_cache_use_kernel, {"state_ptr": p("i32"), "ids_ptr": p("i64")},
                 dict(CAPPED=capped, **lo), 4, arch)
        n += 2
        if not capped:
            compile_(_cache_prefetch_kernel, {"state_ptr": p("i32"), "pred_ptr": p("i32")},
                     dict(N=2, **lo), 4, arch)
            n += 1
    # Quantized slab rows: every format (fp8 decoded with integer ops: no fp8 hardware
    # needed on sm_80) for OLMoE-1B-7B at decode (H=2048, F=1024, k=8, T=1).
    for arch, fmt in itertools.product((80, 90), FORMATS):
        c1, c2 = map(dict, quant_launch_config(QuantLayout.of(fmt, 2048, 1024)))
        w1, w2 = c1.pop("num_warps"), c2.pop("num_warps")
        ids = {"slots_ptr": p("i64"), "table_ptr": p("i32")}
        compile_(_quant_gate_up_kernel, {"x_ptr": p("bf16"), "slab_ptr": p("u8"),
                                         "h_ptr": p("fp32"), **ids, **ffn_types,
                                         "w_ptr": p("fp32")},
                 dict(K=8, HAS_TABLE=True, **swiglu, **c1), w1, arch)
        compile_(_quant_down_kernel, {"h_ptr": p("fp32"), "slab_ptr": p("u8"), **ids,
                                      "w_ptr": p("fp32"), "y_ptr": p("bf16"),
                                      "part_ptr": p("fp32"), **ffn_types},
                 dict(K=8, HAS_TABLE=True, HAS_BIAS=False, SCALE_INPUT=False, **c2), w2, arch)
        n += 2
    for arch in (80, 90):
        compile_(_fp8_decode_kernel, {"c_ptr": p("u8"), "out_ptr": p("fp32")},
                 dict(BLOCK=256), 4, arch)
        n += 1
    # GGUF's block types (issue 26) at Qwen3-30B-A3B's expert shape, sm_90 (the decoders are
    # integer arithmetic and byte loads: sm_80 compiles the same code): every type once as
    # gate and down, gate and up of different types (a Q4_K_M row mixes them).
    for i, t in enumerate(BLOCK_TYPES):
        u = BLOCK_TYPES[(i + 1) % len(BLOCK_TYPES)]
        c1, c2 = map(dict, ggml_launch_config(GGMLLayout.of(ggml_format(t, u, t), 2048, 768)))
        w1, w2 = c1.pop("num_warps"), c2.pop("num_warps")
        ids = {"slots_ptr": p("i64"), "table_ptr": p("i32"), "tab_ptr": p("u8")}
        compile_(_ggml_gate_up_kernel, {"x_ptr": p("bf16"), "slab_ptr": p("u8"),
                                        "h_ptr": p("fp32"), **ids, **ffn_types,
                                        "w_ptr": p("fp32")},
                 dict(K=8, HAS_TABLE=True, **swiglu, **c1), w1, 90)
        compile_(_ggml_down_kernel, {"h_ptr": p("fp32"), "slab_ptr": p("u8"), **ids,
                                     "w_ptr": p("fp32"), "y_ptr": p("bf16"),
                                     "part_ptr": p("fp32"), **ffn_types},
                 dict(K=8, HAS_TABLE=True, HAS_BIAS=False, SCALE_INPUT=False, **c2), w2, 90)
        n += 2
    compile_(_ggml_decode_kernel, {"src": p("u8"), "out": p("fp32"), "tab": p("u8")},
             dict(T=12, BLOCK_R=16, BLOCK_K=128), 4, 90)
    n += 1
    # The unsplit down (SPLIT_K=0 through set_ffn_tuning: each program loops over the routed
    # experts; the defaults above split, SPLIT_K_DEFAULT) and the split's sum, Qwen3-30B-A3B's
    # shape on sm_90: float, int4, Q4_K_M rows.
    from psr_kernels._common import _sum_experts_kernel
    ids = {"slots_ptr": p("i64"), "table_ptr": p("i32"), "tab_ptr": p("u8")}
    down_types = {"h_ptr": p("fp32"), "slab_ptr": p("bf16"), **ids, "w_ptr": p("bf16"),
                  "y_ptr": p("bf16"), "part_ptr": p("fp32"), **ffn_types}
    split = dict(K=8, HAS_TABLE=True, HAS_BIAS=False, SCALE_INPUT=False, SPLIT_K=0)
    for fn, (c1, c2) in (
        (_down_kernel, ffn_launch_config(1, 2048, 768)),
        (_quant_down_kernel, quant_launch_config(QuantLayout.of("int4", 2048, 768))),
        (_ggml_down_kernel,
         ggml_launch_config(GGMLLayout.of(ggml_format("Q4_K", "Q4_K", "Q6_K"), 2048, 768))),
    ):
        c2 = dict(c2)
        w2 = c2.pop("num_warps")
        slab = {"slab_ptr": p("bf16" if fn is _down_kernel else "u8")}
        compile_(fn, {**down_types, **slab}, {**c2, **split}, w2, 90)
        n += 1
    compile_(_sum_experts_kernel, {"part_ptr": p("fp32"), "y_ptr": p("bf16")},
             dict(K=8, BLOCK_H=1024), 4, 90)
    n += 1
    # The grouped prefill GEMM (psr_kernels.grouped_ffn) at Qwen3-30B-A3B's expert shape:
    # float rows (bf16 x: TF32 dots; fp32 x: exact fp32, sm_80 too), every quantized format,
    # GGML mixes of each decoder family; gpt-oss's and Llama 4's kinds once.
    from psr_kernels.grouped_ffn import (
        _grouped_down_kernel, _grouped_gate_up_kernel, grouped_launch_config,
    )
    from psr_kernels.rowformat import RowFormat

    gcases = [(90, None, "bf16", swiglu), (80, None, "fp32", swiglu), (90, None, "fp32", swiglu)]
    gcases += [(90, q, "bf16", swiglu) for q in FORMATS]
    gcases += [(90, ggml_format(*m), "bf16", swiglu) for m in (
        ("Q4_K", "Q4_K", "Q6_K"), ("IQ2_XXS", "IQ1_M", "Q8_0"), ("MXFP4", "Q5_1", "IQ4_XS"),
        ("FP8_B128", "FP8_B128", "FP8_B128"))]
    gcases += [(90, "int8", "bf16", kind) for kind in expert_kinds[1:]]
    for arch, word, xt, kind in gcases:
        fmt = RowFormat.of_kernel("compile", word)
        c1, c2 = map(dict, grouped_launch_config(fmt.layout(2048, 768)))
        w1, w2 = c1.pop("num_warps"), c2.pop("num_warps")
        gtypes = {"slab_ptr": p("bf16" if fmt.is_float else "u8"), "tiles_ptr": p("i32"),
                  "order_ptr": p("i32"), "table_ptr": p("i32"), "w_ptr": p("fp32"),
                  "tab_ptr": p("i8"), **ffn_types}
        gconsts = dict(HAS_TABLE=not kind["HAS_BIAS"], PRECISION="ieee" if xt == "fp32" else "tf32",
                       **{k2: v for k2, v in kind.items() if k2 != "ACT"})
        compile_(_grouped_gate_up_kernel, {"x_ptr": p(xt), "h_ptr": p("fp32"), **gtypes},
                 dict(ACT=kind["ACT"], **gconsts, **c1), w1, arch)
        compile_(_grouped_down_kernel, {"h_ptr": p("fp32"), "y_ptr": p("fp32"), **gtypes},
                 dict(**gconsts, **c2), w2, arch)
        n += 2
    # Dense layers on stored weights (psr_kernels.linear): block types of each decoder
    # family with a bias (bf16 x; every type's `_ggml_tile` branch is compiled above), MLA's
    # transposed heads, int8 / fp8 / int4 codes (fp32 x); sm_80 once. (All 24 block types
    # compiled too when this was written: 72 s on one core.)
    lin = {"x_ptr": p("bf16"), "w_ptr": p("u8"), "s_ptr": p("fp32"), "b_ptr": p("bf16"),
           "y_ptr": p("bf16"), "tab_ptr": p("u8")}
    some = ("BF16", "Q8_0", "Q4_K", "Q6_K", "MXFP4", "IQ2_XXS", "FP8_B128")
    lin_cases = [(90, LinearFormat.parse(t), True, False) for t in some]
    lin_cases += [(90, LinearFormat.parse(t), False, True) for t in ("Q8_0", "F16")]
    lin_cases += [(90, LinearFormat.parse(q, 32 if q == "int4" else None), False, False)
                  for q in FORMATS]
    lin_cases += [(80, LinearFormat.parse("Q4_K"), True, False)]
    for arch, fmt, bias, trans in lin_cases:
        x = {} if fmt.block is not None else {"x_ptr": p("fp32"), "y_ptr": p("fp32")}
        compile_(_linear_kernel, {**lin, **x}, linear_constexprs(fmt, bias, trans),
                 NUM_WARPS, arch)
        n += 1
    def key(job):
        module, name, types, consts, warps, arch = job
        fn = getattr(importlib.import_module(module), name)
        sig = tuple(types.get(a, "i32") for a in fn.arg_names if a not in consts)
        const = tuple(sorted((k, type(v).__name__, v) for k, v in consts.items()))
        return module, name, sig, const, warps, arch

    # Variants that differ only in what the kernel ignores (the cache kernels' layout does
    # not depend on the decode kernel's n; shapes with equal H, k and tiles) compile to the
    # same binary: each is compiled once. The fused decode kernel (5-20 s per variant on one
    # core) and the router go first, so the pool does not end on one long compile.
    unique = list({key(j): j for j in JOBS}.values())
    cost = {"_decode_kernel": 0, "_route_kernel": 1}
    unique.sort(key=lambda j: (cost.get(j[1], 2), -j[3].get("E", 0)))
    if __name__ == "__main__":
        with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1) as pool:
            done = list(pool.map(build, unique))
        assert len(JOBS) == n and len(done) == len(unique)
        print("compiled", n, "variants,", len(unique), "distinct")
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
    assert "compiled 201 variants, 179 distinct" in r.stdout
