"""Wiring of the verifier server: config -> worker -> gRPC (health, reflection, tracing, metrics)."""

from __future__ import annotations

from crossdraft.serving import modelserver
from crossdraft.v1 import verifier_pb2_grpc

from .service import VerifierServicer

SERVICE_NAME = "crossdraft.v1.VerifierService"
DEFAULT_PORT = 50062


def main(argv=None) -> int:
    return modelserver.main("verifier", DEFAULT_PORT, SERVICE_NAME, VerifierServicer(),
                            verifier_pb2_grpc.add_VerifierServiceServicer_to_server, argv)
