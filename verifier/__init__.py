"""The verifier service: the target model verifying draft blocks over gRPC (crossdraft.v1.VerifierService)."""
