"""Evaluation: the latency model (`latency`), the quality harness (`quality`, `harness`),
reports (`report`), the demo / eval / sweep runs (`runs`), the lm-eval adapter and the
copy microbenchmark. Nothing in psr below this package imports it."""
