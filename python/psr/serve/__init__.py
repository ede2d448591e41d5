"""`psr serve`: an OpenAI- and Anthropic-compatible streaming server for one offloaded
checkpoint.

  protocol  request bodies checked into requests; problems into OpenAI error bodies
  chat      messages into a prompt: a --chat-template file, the checkpoint's, or a fallback;
            the template's tool-call format and reasoning (`features`)
  tools     the tool-call formats, one module per template family, their grammars, and
            the stream that turns call markup into calls
  output    a reply's text into reasoning, content and calls (both APIs' one parser)
  anthropic the Messages API: its requests into chat requests, its blocks and events
  stops     streamed text: incremental detokenizing and stop-string hold-back
  decoding  penalties and the grammar mask (llguidance) as a logits processor; logprobs
  engine    the FIFO queue and the one worker thread that decodes (batch 1), cancellation
  metrics   the Prometheus registry (prometheus_client)
  access    API keys and X-Request-Id: an ASGI middleware
  app       the FastAPI app: endpoints, SSE framing, responses, CORS
  bench     `psr bench serve`: streaming requests against model.generate on the same prompts

Importing this package imports no web framework and no torch: `decoding` (and so
`engine`, `app`, `bench`) imports torch, `app` and `bench` the web framework.
"""
