"""Wiring of the drafter server: config -> worker -> gRPC (health, reflection, tracing, metrics)."""

from __future__ import annotations

from crossdraft.serving import modelserver
from crossdraft.v1 import drafter_pb2_grpc

from .service import DrafterServicer

SERVICE_NAME = "crossdraft.v1.DrafterService"
DEFAULT_PORT = 50061


def main(argv=None) -> int:
    return modelserver.main("drafter", DEFAULT_PORT, SERVICE_NAME, DrafterServicer(),
                            drafter_pb2_grpc.add_DrafterServiceServicer_to_server, argv)
