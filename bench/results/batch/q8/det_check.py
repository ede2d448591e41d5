"""generate against generate_batch on bench/batch.py's qwen3-gguf file (README.md here):

    OMP_NUM_THREADS=1 PYTHONPATH=python:. python bench/results/batch/q8/det_check.py \
        psr 0.5 f32 auto q8
"""

import random
import sys

import psr

PATH = "/tmp/psr-bench-batch/qwen3-2l-8192v.gguf"  # written by bench/batch.py
P, n, N = 32, 4, 32
rng = random.Random(1)  # bench/batch.py's prompts
prompts = [[rng.randrange(259, 8192) for _ in range(P)] for _ in range(n)]
mode, residency = sys.argv[1], float(sys.argv[2])
for dot in sys.argv[3:]:
    m = psr.load(PATH, mode, residency, experts_on="cpu", threads=1, progress=False, cpu_dot=dot)
    solo = [m.generate(p, max_new_tokens=N)[0, len(p) :].tolist() for p in prompts]
    for inv in (True, False):
        got = [list(g)[-N:] for g in m.generate_batch(prompts, N, batch_invariant=inv)]
        pairs = [list(zip(g, s, strict=True)) for g, s in zip(got, solo, strict=True)]
        d = [sum(a != b for a, b in ps) for ps in pairs]
        first = [next((i for i, (a, b) in enumerate(ps) if a != b), None) for ps in pairs]
        kind = "invariant" if inv else "plain"
        print(dot, kind, "differing per request", d, "first index", first, flush=True)
