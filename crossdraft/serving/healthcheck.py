"""Container health checks (the images' HEALTHCHECK):
`python -m crossdraft.serving.healthcheck drafter|verifier|gateway`.

Exit 0 when the local server is healthy, 1 otherwise. They read the servers' own env:

* drafter / verifier: gRPC health on ``CROSSDRAFT_HEALTH_PORT`` (the plaintext health-only port a
  TLS server opens) when set, else on ``CROSSDRAFT_PORT`` (a plaintext server).
* gateway: ``/readyz`` on ``CROSSDRAFT_HTTP_PORT``, over HTTPS when ``CROSSDRAFT_TLS_CERT_FILE`` is
  set (the local check does not verify the certificate: it asks the process next to it).
"""

from __future__ import annotations

import os
import sys

DEFAULT_PORTS = {"drafter": "50061", "verifier": "50062"}


def check(kind: str, timeout_s: float = 5.0) -> bool:
    if kind in DEFAULT_PORTS:
        from crossdraft.serving.rpc import wait_healthy

        port = os.environ.get("CROSSDRAFT_HEALTH_PORT") or os.environ.get("CROSSDRAFT_PORT") or DEFAULT_PORTS[kind]
        if port == "0":
            port = os.environ.get("CROSSDRAFT_PORT") or DEFAULT_PORTS[kind]
        return wait_healthy(f"127.0.0.1:{port}", timeout_s)
    if kind == "gateway":
        import ssl
        import urllib.request as u

        tls = bool(os.environ.get("CROSSDRAFT_TLS_CERT_FILE"))
        url = f"{'https' if tls else 'http'}://127.0.0.1:{os.environ.get('CROSSDRAFT_HTTP_PORT', '8000')}/readyz"
        handlers = [u.ProxyHandler({})]
        if tls:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            handlers.append(u.HTTPSHandler(context=ctx))
        try:
            return u.build_opener(*handlers).open(url, timeout=timeout_s).status == 200
        except OSError:
            return False
    raise SystemExit(f"usage: python -m crossdraft.serving.healthcheck drafter|verifier|gateway (got {kind!r})")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return 0 if check(argv[0] if argv else "") else 1


if __name__ == "__main__":
    sys.exit(main())
