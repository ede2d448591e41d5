"""Evaluation sizes, the latency profiles reported and the tuning budget: one place,
importable without torch (the CLI reads them to build its help)."""

# The powered defaults: 160 windows x 128 decode-path tokens = 20,480 scored tokens.
WINDOWS = 160
WINDOW_TOKENS = 160
PROMPT_TOKENS = 32
BUDGET = 0.01  # nats/token: the 95% upper bound of the quality cost a tuned point may have
SWEEP_LAMS = (0.03, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)  # from the untuned default (policy.py) up
SWEEP_NS = (0, 1, 2)
DEFAULT_PROFILES = ("rtx4090", "h200")  # the latency profiles tables report, first = main
# `psr tune`'s greedy agreement on set B: a few prompts, next to its Δ nats/token.
TUNE_PROMPTS = 2
TUNE_GEN_TOKENS = 32
PROFILE = "rtx4090"  # the latency profile points are tuned for unless told otherwise
