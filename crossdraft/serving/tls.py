"""TLS for crossdraft's listeners and channels: files in, credentials out, re-read when they change.

Who uses what
-------------
* **Model servers (drafter, verifier)**: ``--tls-cert-file`` + ``--tls-key-file`` turn TLS on and
  ``--tls-client-ca-file`` is then required: a caller must present a certificate signed by that CA
  (mutual TLS), or the handshake fails. The kubelet cannot present one (its gRPC probe has no TLS
  at all), so a TLS model server can open ``--health-port``: a plaintext gRPC port that serves
  ONLY ``grpc.health.v1`` (serving / not serving, nothing else).
* **Gateway, public side**: ``--tls-cert-file`` + ``--tls-key-file`` serve REST over HTTPS and the
  gateway's gRPC API over TLS (clients verify it with a CA bundle: ``crossdraft.client.Client(...,
  tls_ca_file=...)``, the CLI's ``--tls-ca-file``).
* **Gateway, to the model servers**: ``--upstream-tls-ca-file`` (the CA of the model servers'
  certificates) turns TLS on for those channels; ``--upstream-tls-cert-file`` +
  ``--upstream-tls-key-file`` is the gateway's client certificate; ``--upstream-tls-server-name``
  the name to expect in the servers' certificates when they are dialled by pod IP.

Rotation: Kubernetes updates a mounted Secret in place. Servers check the files' (mtime, size) at
every new handshake (gRPC: ``dynamic_ssl_server_credentials``; REST: a watcher thread reloading
the live ``SSLContext``), so new connections get the new certificate and open ones carry on.
Client channels compare the files before each call and switch to a new channel when they change;
the old one is closed after a grace period, so calls in flight finish.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass

from crossdraft.errors import InvalidArgument

log = logging.getLogger("crossdraft.serving.tls")

__all__ = ["FileWatch", "TLSConfig", "channel_credentials", "server_credentials", "watch_ssl_context"]


def _read(field: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InvalidArgument(field, f"cannot read {path}: {e.strerror or e}") from None
    if b"-----BEGIN" not in data:
        raise InvalidArgument(field, f"{path} is not a PEM file")
    return data


@dataclass(frozen=True)
class TLSConfig:
    """Certificate files of one side of a connection (paths; empty = not set).

    ``names`` maps the fields to the flag names errors should mention."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    server_name: str = ""  # clients only: the name to verify in the server's certificate
    prefix: str = "tls"  # flag prefix for messages: tls -> --tls-cert-file, upstream_tls -> --upstream-tls-...

    def _flag(self, what: str) -> str:
        return f"{self.prefix}_{what}"

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.ca_file)

    def check_server(self, require_client_ca: bool) -> None:
        """Validate a listener's files now (clear errors at startup, not at the first handshake)."""
        if not (self.cert_file or self.key_file or self.ca_file):
            return
        if not self.cert_file or not self.key_file:
            raise InvalidArgument(self._flag("cert_file"), "TLS needs both a certificate and a key file")
        if require_client_ca and not self.ca_file:
            raise InvalidArgument(self._flag("client_ca_file"),
                                  "is required with TLS on a model server (callers must present a certificate)")
        self._check_pair()
        if self.ca_file:
            _check_ca(self._flag("client_ca_file"), self.ca_file)

    def check_client(self) -> None:
        if not self.enabled:
            return
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidArgument(self._flag("cert_file"), "a client certificate needs both a certificate and a key")
        if self.ca_file:
            _check_ca(self._flag("ca_file"), self.ca_file)
        if self.cert_file:
            self._check_pair()

    def _check_pair(self) -> None:
        _read(self._flag("cert_file"), self.cert_file)
        _read(self._flag("key_file"), self.key_file)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as e:
            raise InvalidArgument(self._flag("key_file"),
                                  f"does not match the certificate {self.cert_file} ({e.reason or e})") from None

    def files(self) -> list[str]:
        return [p for p in (self.cert_file, self.key_file, self.ca_file) if p]


def _check_ca(field: str, path: str) -> None:
    _read(field, path)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=path)
    except ssl.SSLError as e:
        raise InvalidArgument(field, f"{path} holds no usable CA certificate ({e.reason or e})") from None


class FileWatch:
    """Whether a set of files changed since the last look: (mtime_ns, size, inode) of each."""

    def __init__(self, paths: list[str]):
        self.paths = list(paths)
        self._lock = threading.Lock()
        self._last = self._stamp()

    def _stamp(self):
        out = []
        for p in self.paths:
            try:
                st = os.stat(p)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def forget(self) -> None:
        """Report the current state as a change again at the next look (a reload that failed, e.g. a
        certificate already replaced but its key not yet, is retried)."""
        with self._lock:
            self._last = None

    def changed(self) -> bool:
        """True once per change (the new state becomes the reference)."""
        now = self._stamp()
        with self._lock:
            if now == self._last or None in now:  # a file missing mid-rotation: look again later
                return False
            self._last = now
            return True


def server_credentials(cfg: TLSConfig, *, require_client_auth: bool):
    """gRPC server credentials that re-read the files when they change (checked at each new
    handshake); with a CA file and require_client_auth, callers must present a certificate signed
    by it."""
    import grpc

    def config():
        key = _read("tls_key_file", cfg.key_file)
        cert = _read("tls_cert_file", cfg.cert_file)
        ca = _read("tls_client_ca_file", cfg.ca_file) if cfg.ca_file else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    watch = FileWatch(cfg.files())

    def fetch():
        if not watch.changed():
            return None  # keep the current configuration
        try:
            cfg._check_pair()  # a certificate replaced before its key: wait for the pair
            new = config()
            log.info("TLS certificate files changed: new handshakes use them (%s)", cfg.cert_file)
            return new
        except Exception as e:  # half-written files: keep serving with the old ones, look again
            watch.forget()
            log.warning("TLS certificate files changed but cannot be loaded (keeping the old ones): %s", e)
            return None

    return grpc.dynamic_ssl_server_credentials(config(), fetch,
                                               require_client_authentication=bool(require_client_auth and cfg.ca_file))


def channel_credentials(cfg: TLSConfig):
    """gRPC channel credentials: verify the server with the CA file (system roots if none); present
    the client certificate when one is configured."""
    import grpc

    ca = _read(cfg._flag("ca_file"), cfg.ca_file) if cfg.ca_file else None
    key = _read(cfg._flag("key_file"), cfg.key_file) if cfg.key_file else None
    cert = _read(cfg._flag("cert_file"), cfg.cert_file) if cfg.cert_file else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def watch_ssl_context(ctx: ssl.SSLContext, cfg: TLSConfig, stop: threading.Event, interval_s: float = 2.0):
    """Reload a live server SSLContext's certificate chain when the files change (new handshakes
    get it; open connections keep theirs). Runs in a daemon thread until `stop` is set."""
    watch = FileWatch(cfg.files())

    def loop():
        while not stop.wait(interval_s):
            if not watch.changed():
                continue
            try:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
                if cfg.ca_file:
                    ctx.load_verify_locations(cafile=cfg.ca_file)
                log.info("TLS certificate files changed: new HTTPS connections use them (%s)", cfg.cert_file)
            except Exception as e:  # the context keeps its old chain when loading fails
                watch.forget()
                log.warning("TLS certificate files changed but cannot be loaded (keeping the old ones): %s", e)

    t = threading.Thread(target=loop, name="crossdraft-tls-watch", daemon=True)
    t.start()
    return t
