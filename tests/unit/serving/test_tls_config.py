"""TLS flags are checked at startup: a clear error naming the flag, not a failed handshake later."""

from __future__ import annotations

import pytest
import trustme

from crossdraft.errors import InvalidArgument
from crossdraft.serving import modelserver
from crossdraft.serving.tls import FileWatch, TLSConfig
from gateway import server as gateway_server


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    leaf = ca.issue_cert("localhost")
    other = ca.issue_cert("other")
    out = {}
    for name, blob in (("ca", ca.cert_pem), ("cert", leaf.cert_chain_pems[0]), ("key", leaf.private_key_pem),
                       ("other_key", other.private_key_pem)):
        out[name] = str(d / f"{name}.pem")
        blob.write_to_path(out[name])
    out["junk"] = str(d / "junk.pem")
    open(out["junk"], "w").write("not a certificate")
    return out


def _model_args(*extra):
    p = modelserver.argparse.ArgumentParser()
    modelserver.add_arguments(p, 50052)
    return modelserver.config_from_args(p.parse_args(["--model", "x", *extra]))


def test_model_server_tls_needs_a_client_ca(files):
    with pytest.raises(InvalidArgument) as e:
        _model_args("--tls-cert-file", files["cert"], "--tls-key-file", files["key"])
    assert e.value.field == "tls_client_ca_file"
    cfg = _model_args("--tls-cert-file", files["cert"], "--tls-key-file", files["key"],
                      "--tls-client-ca-file", files["ca"], "--health-port", "0")
    assert cfg.tls.cert_file == files["cert"] and cfg.tls.ca_file == files["ca"]


@pytest.mark.parametrize("flags, field", [
    (["--tls-cert-file", "CERT"], "tls_cert_file"),  # no key
    (["--tls-cert-file", "CERT", "--tls-key-file", "OTHER_KEY", "--tls-client-ca-file", "CA"], "tls_key_file"),
    (["--tls-cert-file", "CERT", "--tls-key-file", "KEY", "--tls-client-ca-file", "JUNK"], "tls_client_ca_file"),
    (["--tls-cert-file", "/no/such.pem", "--tls-key-file", "KEY", "--tls-client-ca-file", "CA"], "tls_cert_file"),
])
def test_bad_model_server_tls_files_name_the_flag(files, flags, field):
    sub = {"CERT": files["cert"], "KEY": files["key"], "OTHER_KEY": files["other_key"], "CA": files["ca"],
           "JUNK": files["junk"]}
    with pytest.raises(InvalidArgument) as e:
        _model_args(*[sub.get(f, f) for f in flags])
    assert e.value.field == field, e.value


def _gateway_args(*extra, redis="redis://127.0.0.1:6379/0"):
    p = gateway_server.build_parser()
    return gateway_server.config_from_args(p.parse_args(["--verifier", "127.0.0.1:1", "--redis-url", redis, *extra]))


def test_gateway_tls_flags(files, tmp_path, monkeypatch):
    cfg = _gateway_args("--tls-cert-file", files["cert"], "--tls-key-file", files["key"],
                        "--upstream-tls-ca-file", files["ca"], "--upstream-tls-cert-file", files["cert"],
                        "--upstream-tls-key-file", files["key"], "--upstream-tls-server-name", "localhost")
    assert cfg.tls.cert_file and cfg.upstream_tls.enabled and cfg.upstream_tls.server_name == "localhost"
    with pytest.raises(InvalidArgument) as e:
        _gateway_args("--upstream-tls-cert-file", files["cert"], "--upstream-tls-key-file", files["key"])
    assert e.value.field == "upstream_tls_ca_file"
    with pytest.raises(InvalidArgument) as e:
        _gateway_args("--tls-cert-file", files["cert"], "--tls-key-file", files["other_key"])
    assert e.value.field == "tls_key_file"
    with pytest.raises(InvalidArgument) as e:
        _gateway_args("--redis-tls-ca-file", files["ca"])
    assert e.value.field == "redis_tls_ca_file"
    pw = tmp_path / "pw"
    pw.write_text("hunter2\n")
    monkeypatch.setenv("REDIS_PASSWORD", "from-env")
    cfg = _gateway_args("--redis-password-file", str(pw), "--redis-tls-ca-file", files["ca"],
                        redis="rediss://127.0.0.1:6380/0")
    assert cfg.redis_password == "hunter2" and "hunter2" not in repr(cfg)
    assert _gateway_args().redis_password == "from-env"


def test_file_watch_reports_each_change_once(tmp_path):
    a = tmp_path / "a.pem"
    a.write_text("one")
    w = FileWatch([str(a)])
    assert not w.changed()
    a.write_text("two, longer")
    assert w.changed() and not w.changed()
    w.forget()
    assert w.changed()  # a failed reload is retried
    a.unlink()
    assert not w.changed()  # mid-rotation (file missing): wait


def test_redis_urls_are_redacted():
    from gateway.sessions import redact_url

    assert redact_url("rediss://:pw@host:6380/0") == "rediss://host:6380/0"
    assert redact_url("redis://user:pw@host/1") == "redis://host/1"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"


def test_tls_config_enabled():
    assert not TLSConfig().enabled
    assert TLSConfig(ca_file="x").enabled and TLSConfig(cert_file="x").enabled
