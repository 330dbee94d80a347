"""The drafter service: a small model proposing draft tokens over gRPC (crossdraft.v1.DrafterService)."""
