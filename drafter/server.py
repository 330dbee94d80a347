"""Wiring of the drafter server: config -> worker -> gRPC (health, reflection, tracing, metrics)."""

from __future__ import annotations

import argparse
import sys

from crossdraft import modelserver
from crossdraft.errors import CrossdraftError
from crossdraft.v1 import drafter_pb2_grpc
from crossdraft.workers import DrafterWorker, WorkerConfig

from .service import DrafterServicer

SERVICE_NAME = "crossdraft.v1.DrafterService"
DEFAULT_PORT = 50061


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m drafter", description="crossdraft drafter service (gRPC)")
    modelserver.add_arguments(p, DEFAULT_PORT)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = modelserver.config_from_args(args)
    except CrossdraftError as e:
        print(f"drafter: error: {e}", file=sys.stderr)
        return 2
    servicer = DrafterServicer()
    wcfg = WorkerConfig(max_sessions=cfg.max_sessions, session_ttl_s=cfg.session_ttl_s)
    return modelserver.serve("drafter", cfg, lambda loaded: DrafterWorker(loaded, wcfg),
                             lambda s: drafter_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, s),
                             SERVICE_NAME, servicer)
