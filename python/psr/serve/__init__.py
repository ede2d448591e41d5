"""`psr serve`: an OpenAI-compatible streaming server for one offloaded checkpoint.

  protocol  request bodies checked into requests; problems into OpenAI error bodies
  chat      messages into a prompt: the checkpoint's chat template, else a plain fallback
  stops     streamed text: incremental detokenizing and stop-string hold-back
  engine    the FIFO queue and the one worker thread that decodes (batch 1), cancellation
  metrics   the Prometheus registry (prometheus_client)
  app       the FastAPI app: endpoints, SSE framing, responses
  bench     `psr bench serve`: streaming requests against model.generate on the same prompts

Importing this package imports no web framework and no torch: `app` and `bench` do.
"""
