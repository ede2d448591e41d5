"""Write psr's embedded model as a GGUF file, the way llama.cpp's converter writes one
(tensor names, metadata, tokenizer: tests/gguf_files.py), to try psr's GGUF path offline.

    .venv/bin/python scripts/embedded_to_gguf.py OUT.gguf [--type Q8_0] [--dense F32]

`--type`: the experts' GGML type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, F16, BF16, F32:
gguf-py's quantizers; the embedded model's rows of 128 and 32 are too short for K-quants).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="Q8_0", help="the experts' GGML type")
    ap.add_argument("--dense", default="F32", help="the other matrices' GGML type")
    a = ap.parse_args()
    from gguf_files import write_gguf
    from transformers import AutoTokenizer

    from psr.models import DEFAULT_MODEL

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    write_gguf(DEFAULT_MODEL, a.out, {"experts": a.type, "dense": a.dense}, tokenizer=tok)
    print(f"wrote {a.out} ({a.out.stat().st_size / 2**20:.1f} MiB): experts {a.type}")


if __name__ == "__main__":
    main()
