"""The processes `crossdraft up` supervises: readiness probes (gRPC health for the model servers,
``GET /readyz`` for the gateway), the tail of a child's log, a port check, and signals to a child's
process group (each child leads its own session, so anything it spawned goes with it)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
from pathlib import Path


class GrpcHealthProbe:
    """Standard gRPC health ``Check(service="")``; ready when SERVING."""

    def __init__(self, target: str):
        import grpc  # lazy: the crossdraft core imports no gRPC at module import time

        self._channel = grpc.insecure_channel(target)
        self.target = target

    def __call__(self) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self._channel.close()


class HttpProbe:
    """``GET url``; ready on 200."""

    def __init__(self, url: str):
        self.target = url

    def __call__(self) -> bool:
        import requests

        try:
            return requests.get(self.target, timeout=1.0).status_code == 200
        except requests.RequestException:
            return False

    def close(self) -> None:
        pass


def log_tail(path: Path | None, max_lines: int = 40) -> str:
    """The last lines of a child's log ("" without one)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-max_lines:])


def port_in_use(host: str, port: int) -> bool:
    """Whether ``host:port`` is taken (binding it fails with EADDRINUSE; other errors raise)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the child's process group (it leads its own session), or to it alone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
