"""psr_kernels: Triton kernels for cache-biased MoE routing (torch + triton only)."""
