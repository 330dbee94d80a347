"""The gateway: public REST + gRPC APIs, tokenization, the vocabulary mapping, the round loop,
sessions in Redis, and a trace span per verification round."""
