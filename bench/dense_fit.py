"""The dense part psr puts on the device per `dense_format`, for the header-faithful GGUF
files of bench/fit_table.py (DeepSeek-V3, Kimi-K2, GLM-4.5-Air, Qwen3-235B-A22B,
gpt-oss-120b, Qwen3-30B-A3B), beside llama.cpp's (every non-expert tensor in its file type).

    PYTHONPATH=python:. python bench/dense_fit.py [--dir /tmp/psr-dense-fit] [--out DIR]

Figures from the header alone (`psr.models.dense_bytes.gguf_dense_bytes`, the rule
psr.load follows: tested equal to `model.memory()` on tiny files): "float" (before: every
dense tensor dequantized to the dtype) and "native" (after: the dense matrices in the
file's blocks), at float32 (the GGUF default) and bfloat16. Files are written sparse and
deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.fit_table import SPECS, nbytes, tensors, write

GiB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/psr-dense-fit")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    from psr.models.dense_bytes import gguf_dense_bytes
    from psr.models.gguf_load import open_gguf

    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, s in SPECS.items():
        files = write(s, d / (name.split()[0] + ".gguf"))
        try:
            ck = open_gguf(files[0])
            try:
                got = {
                    f"{fmt}_{dt}": gguf_dense_bytes(ck, fmt, size)
                    for fmt in ("float", "native")
                    for dt, size in (("f32", 4), ("bf16", 2))
                }
            finally:
                ck.close()
        finally:
            for f in files:
                f.unlink()
        llama = sum(nbytes(sh, t) for n, sh, t in tensors(s) if "_exps." not in n)
        rows.append(dict(model=name, llama_dense=llama, **got))
    cmd = "PYTHONPATH=python:. python bench/dense_fit.py " + " ".join(
        f"--{k} {v}" for k, v in vars(a).items() if v
    )
    out = [
        "# Dense part on the device per dense_format (GiB)",
        "",
        f"Command: `{cmd}`",
        "",
        "psr.models.dense_bytes.gguf_dense_bytes on bench/fit_table.py's header-faithful "
        "files; llama.cpp: every non-expert tensor in its file type (`--cpu-moe`).",
        "",
        "| model | float f32 (before) | native f32 (after) | float bf16 | native bf16 | "
        "llama.cpp | native f32 / llama.cpp |",
        "|" + "---|" * 7,
    ]
    for r in rows:
        g = {k: f"{v / GiB:.2f}" for k, v in r.items() if k != "model"}
        out.append(
            f"| {r['model']} | {g['float_f32']} | {g['native_f32']} | {g['float_bf16']} | "
            f"{g['native_bf16']} | {g['llama_dense']} | "
            f"{r['native_f32'] / r['llama_dense']:.2f}x |"
        )
    md = "\n".join(out) + "\n"
    print(md)
    if a.out:
        o = Path(a.out)
        o.mkdir(parents=True, exist_ok=True)
        (o / "dense_fit.md").write_text(md)
        (o / "dense_fit.json").write_text(json.dumps(dict(command=cmd, rows=rows), indent=1))


if __name__ == "__main__":
    main()
