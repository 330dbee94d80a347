"""Serving: what the three services share on the network and around their processes.

gRPC helpers and error mapping (`rpc`), TLS and mTLS (`tls`), message conversion (`wire`), the
model servers' shell (`modelserver`), tracing and metrics (`telemetry`), the images' health check
(`healthcheck`), the embedded Redis (`redis_server`), the whole stack on one machine (`up`, with
its children's probes and signals in `children`) and the wire contract's compatibility check
(`protocompat`). It may import every package of crossdraft below it (decoding, vocab, models,
runtime); never a service.
"""
