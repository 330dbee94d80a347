"""Wiring of the verifier server: config -> worker -> gRPC (health, reflection, tracing, metrics)."""

from __future__ import annotations

import argparse
import sys

from crossdraft import modelserver
from crossdraft.errors import CrossdraftError
from crossdraft.v1 import verifier_pb2_grpc
from crossdraft.workers import VerifierWorker, WorkerConfig

from .service import VerifierServicer

SERVICE_NAME = "crossdraft.v1.VerifierService"
DEFAULT_PORT = 50062


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verifier", description="crossdraft verifier service (gRPC): the target model")
    modelserver.add_arguments(p, DEFAULT_PORT)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = modelserver.config_from_args(args)
    except CrossdraftError as e:
        print(f"verifier: error: {e}", file=sys.stderr)
        return 2
    servicer = VerifierServicer()
    wcfg = WorkerConfig(max_sessions=cfg.max_sessions, session_ttl_s=cfg.session_ttl_s)
    return modelserver.serve("verifier", cfg, lambda loaded: VerifierWorker(loaded, wcfg),
                             lambda s: verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, s),
                             SERVICE_NAME, servicer)
