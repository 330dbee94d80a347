"""The gateway: the public REST and gRPC front door. Its modules: ``server`` (flags and wiring),
``service`` (the gRPC servicer), ``rest`` with ``rest_input``, ``rest_json``, ``rest_stream`` and
``rest_errors`` (the OpenAI-compatible REST layer), ``openapi`` (its document), ``core`` (the
``Gateway``: pairing, decoders, readiness, sessions), ``job`` (one request's run), ``config``,
``validation``, ``auth``, ``admission``, ``metrics``, ``clients`` (the model servers), ``discovery``
(their pods), ``sessions`` (Redis) and ``memtrace``. It imports crossdraft's base, vocab, decoding,
models and serving layers, never the runtime (a gateway pod runs no model)."""
