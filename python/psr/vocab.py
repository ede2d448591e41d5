"""The words psr's options accept, in one torch-free place: dtype names, expert formats and
compute paths. The CLI validates its arguments with them before torch is imported, and
`psr.models.loader` resolves them; `psr_kernels` keeps its own copies (it never imports
psr), which tests/bookkeeping/test_vocab.py holds equal to these.
"""

from __future__ import annotations

import re

# Every accepted dtype spelling -> the canonical torch dtype name (`torch.<name>`).
DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")

# How the host store keeps experts and copies move them: "native" (the model's dtype),
# "bf16", or quantized rows that the kernels dequantize on the fly.
QUANT_FORMATS: tuple[str, ...] = ("int8", "fp8", "int4")
# Each word's store format (None: the model's own dtype; psr_kernels.RowFormat parses it).
_STORE_FORMATS: dict[str | None, str | None] = {
    None: None,
    "native": None,
    "bf16": "bf16",
    **{f: f for f in QUANT_FORMATS},
}
EXPERT_FORMATS: tuple[str, ...] = tuple(w for w in _STORE_FORMATS if w is not None)

# How a load keeps the dense (non-expert) weights on the device: "native" (as the file
# stores them: a GGUF file's GGML blocks, computed by psr's dense kernels; a float
# checkpoint's floats in the model dtype), "float" (everything dequantized to the dtype),
# or, for a float checkpoint, quantized at load per output channel: "int8" / "fp8".
DENSE_FORMATS: tuple[str, ...] = ("native", "float", "int8", "fp8")

# How the KV cache keeps keys and values: "auto" (transformers' own, in the model dtype),
# "bf16", or quantized with a scale per (token, head), "int8" / "fp8" (psr.runtime.kv's
# KV_FORMATS says what each stores; psr.runtime.kv_quant builds them).
KV_FORMATS: tuple[str, ...] = ("auto", "bf16", "int8", "fp8")
# What psr.load and the CLI take: a KV format, or "fit" (with gpu_memory: the memory plan
# picks the first of KV_FIT_ORDER whose plan fits, models/memory_plan.py).
KV_CHOICES: tuple[str, ...] = (*KV_FORMATS, "fit")
KV_FIT_ORDER: tuple[str, ...] = ("auto", "int8", "fp8")  # least loss first

# Compute paths: "auto" (Triton on CUDA, the torch references elsewhere; $PSR_COMPUTE
# overrides), or one forced.
COMPUTE_CHOICES: tuple[str, ...] = ("auto", "triton", "torch")
# How the CPU kernels dot GGML rows with their activations (psr.store.cpu_kernels): 'auto'
# (integer dots on Q8-quantized activations for the block types where they are measured
# faster on this CPU, fp32 for the rest), 'f32', 'q8', 'q8_madd' (q8 without AVX-512 VNNI's
# vpdpbusd: the same bits).
CPU_DOTS: tuple[str, ...] = ("auto", "f32", "q8", "q8_madd")

# How a decode step runs: "device" (the sync-free step on device-resident caches, wherever
# the policy allows it) or "host" (the host-driven step: caches and copies on the host).
DECODE_MODES: tuple[str, ...] = ("device", "host")

# Where a decode step's misses are computed (issue 27): "gpu" (every miss copied into the
# slab, the spec's `use`), "cpu" (no miss copied: computed on the CPU from the host rows)
# or "hybrid" (at most m misses per layer copied, the rest on the CPU).
EXPERTS_ON: tuple[str, ...] = ("gpu", "cpu", "hybrid")

# How a speculative verify block bounds the experts its tokens need (issue 41 item 2):
# "budget" (one set of at most block_k experts per layer for the block, each token's top-k
# inside it) or "cpu" (each token's own top-k; the union's members outside the slab computed
# on the CPU, at most M of its misses copied per layer and block: 'cpu:M').
VERIFY_MODES: tuple[str, ...] = ("budget", "cpu")
# Speculative drafters (psr.models.drafters): "block" (heads on the target's hidden
# state), "ar" (a small dense LM), "mtp" (the checkpoint's multi-token-prediction layer,
# or psr's trained one beside the embedded model).
DRAFTERS: tuple[str, ...] = ("block", "ar", "mtp")


def canonical_dtype(name: str) -> str:
    """The canonical dtype name of an accepted spelling (`torch.` prefix allowed)."""
    key = name.removeprefix("torch.") if isinstance(name, str) else name
    if key not in DTYPE_ALIASES:
        raise ValueError(
            f"unsupported dtype {name!r}; use one of {', '.join(DTYPE_NAMES)} "
            f"(or {', '.join(a for a in DTYPE_ALIASES if a not in DTYPE_NAMES)})"
        )
    return DTYPE_ALIASES[key]


def expert_format(fmt: str | None) -> str | None:
    """The store format of an `expert_format` argument: None for "native" (or None), else
    one of "bf16", "int8", "fp8", "int4"; a ValueError names the accepted ones."""
    if fmt not in _STORE_FORMATS:
        raise ValueError(f"expert_format must be one of {', '.join(EXPERT_FORMATS)}; got {fmt!r}")
    return _STORE_FORMATS[fmt]


def dense_format(fmt: str) -> str:
    """A `dense_format` argument checked: one of DENSE_FORMATS."""
    if fmt not in DENSE_FORMATS:
        raise ValueError(f"dense_format must be one of {', '.join(DENSE_FORMATS)}; got {fmt!r}")
    return fmt


def kv_format(fmt: str) -> str:
    """A `kv_format` argument checked: one of KV_FORMATS."""
    if fmt not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {', '.join(KV_FORMATS)}; got {fmt!r}")
    return fmt


def kv_choice(fmt: str) -> str:
    """A `kv_format` option checked: one of KV_CHOICES (a KV format, or "fit")."""
    if fmt not in KV_CHOICES:
        raise ValueError(f"kv_format must be one of {', '.join(KV_CHOICES)}; got {fmt!r}")
    return fmt


def compute_choice(compute: str) -> str:
    """`compute` if it is one of COMPUTE_CHOICES, else a ValueError naming them."""
    if compute not in COMPUTE_CHOICES:
        raise ValueError(f"compute must be one of {', '.join(COMPUTE_CHOICES)}; got {compute!r}")
    return compute


def cpu_dot_choice(dot: object) -> str:
    """`dot` if it is one of CPU_DOTS, else a ValueError naming them."""
    if dot not in CPU_DOTS:
        raise ValueError(f"cpu_dot must be one of {', '.join(CPU_DOTS)}; got {dot!r}")
    return str(dot)


def decode_mode(decode: str) -> str:
    """`decode` if it is one of DECODE_MODES, else a ValueError naming them."""
    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}; got {decode!r}")
    return decode


def experts_on_choice(experts_on: str) -> str:
    """`experts_on` if it is one of EXPERTS_ON, else a ValueError naming them."""
    if experts_on not in EXPERTS_ON:
        raise ValueError(f"experts_on must be one of {', '.join(EXPERTS_ON)}; got {experts_on!r}")
    return experts_on


def parse_experts_on(spec: str) -> tuple[str, int | list[int] | None]:
    """`psr.load`'s `experts_on`: 'gpu', 'cpu', 'hybrid' (the caps from the machine
    profile) or 'hybrid:M' / 'hybrid:M1,M2,...' (misses copied per layer step: one for
    every MoE layer, or one per layer). Returns (mode, hybrid_m)."""
    if not isinstance(spec, str):
        raise ValueError(f"experts_on must be a string, got {type(spec).__name__}")
    mode, sep, rest = spec.partition(":")
    experts_on_choice(mode)
    if not sep:
        return mode, None
    if mode != "hybrid":
        raise ValueError(f"experts_on={spec!r}: only 'hybrid' takes a miss-copy cap (hybrid:M)")
    try:
        caps = [int(p) for p in rest.split(",")]
    except ValueError:
        raise ValueError(
            f"experts_on={spec!r}: expected hybrid:M or hybrid:M1,M2,... with integers M"
        ) from None
    return mode, caps[0] if "," not in rest else caps


def parse_verify(spec: str) -> tuple[str, int | None]:
    """`psr.load`'s `verify`: 'budget', 'cpu' or 'cpu:M' (at most M misses copied per MoE
    layer and verify block; plain 'cpu': psr.policy.default_verify_copies). Returns (mode,
    M or None)."""
    if not isinstance(spec, str):
        raise ValueError(f"verify must be a string, got {type(spec).__name__}")
    mode, sep, rest = spec.partition(":")
    if mode not in VERIFY_MODES:
        raise ValueError(
            f"verify must be one of {', '.join(VERIFY_MODES)} (or cpu:M); got {spec!r}"
        )
    if not sep:
        return mode, None
    if mode != "cpu":
        raise ValueError(f"verify={spec!r}: only 'cpu' takes a miss-copy budget (cpu:M)")
    if not rest.isdigit():
        raise ValueError(f"verify={spec!r}: expected cpu:M with an integer M >= 0")
    return mode, int(rest)


def graphs_choice(graphs: object) -> bool | str:
    """`graphs` if it is True, False or "auto", else a ValueError."""
    if isinstance(graphs, bool) or graphs == "auto":
        return "auto" if graphs == "auto" else bool(graphs)
    raise ValueError(f"graphs must be True, False or 'auto'; got {graphs!r}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(value: str | int, what: str = "host_memory") -> int:
    """'48GB' (10^9), '48GiB' (2^30), '512MiB', '1.5GB' or an int of bytes; ValueError
    naming `what` otherwise (no silent clamping: negative or malformed is an error)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{what} must be a size like '48GB' or an int of bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must be >= 0 bytes, got {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{what} must be a size like '48GB', '48GiB', '512MiB' or an int of bytes, "
            f"got {value!r}"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def host_memory(value: object) -> str | int:
    """A `host_memory` argument: 'unlimited', or a size parse_bytes reads (checked here,
    so a bad one fails before anything loads)."""
    if value == "unlimited":
        return "unlimited"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"host_memory must be a size like '48GB' or 'unlimited', got {value!r}")
    parse_bytes(value)
    return value
