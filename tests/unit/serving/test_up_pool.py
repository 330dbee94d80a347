"""`crossdraft up --drafter A --drafter B`: several drafter kinds, each its own service (issue 41).

Command lines and config parsing only (no model loads); one Stack test with fake health servers
checks that readiness covers every drafter.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import sys
import textwrap

import pytest

from crossdraft import cli
from crossdraft.errors import InvalidArgument
from crossdraft.serving import up, upconfig
from crossdraft.serving.up import DrafterKind, Stack, StackError, UpConfig, child_commands, resolve_ports

pytestmark = pytest.mark.timeout(120)

REDIS = "redis://127.0.0.1:7000/0"


def parse(argv: list[str]) -> UpConfig:
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    return up.config_from_args(p.parse_args(argv), environ={})


def commands(argv: list[str], monkeypatch=None) -> dict[str, list[str]]:
    """The children's command lines for `crossdraft up ARGV` (ports after the given ones: taken by nothing)."""
    if monkeypatch is not None:
        monkeypatch.setattr(upconfig, "port_in_use", lambda host, port: False)
    cfg = dataclasses.replace(parse(argv), redis_url=REDIS, python="/py")
    return child_commands(resolve_ports(cfg))


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def refused(argv: list[str], capsys) -> str:
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


# -- one drafter: today's commands -------------------------------------------------------------


def test_one_drafter_gives_todays_commands(monkeypatch):
    argv = ["--target", "T", "--drafter", "D", "--drafter-dtype", "float32", "--drafter-device", "cuda:0",
            "--drafter-cpus", "0-1", "--drafter-port", "6001", "--drafter-metrics-port", "9101",
            "--drafter-revision", "v1", "--drafter-file", "m.gguf", "--verifier-port", "6002", "--http-port", "8123",
            "--grpc-port", "6051"]  # fmt: skip
    cfg = parse(argv)
    assert (cfg.drafter, cfg.drafter_name, cfg.more_drafters) == ("D", None, ())
    assert (cfg.drafter_dtype, cfg.drafter_device, cfg.drafter_cpus, cfg.drafter_port, cfg.drafter_metrics_port,
            cfg.drafter_revision, cfg.drafter_file) == ("float32", "cuda:0", (0, 1), 6001, 9101, "v1", "m.gguf")
    cmds = commands(argv)
    assert list(cmds) == ["drafter", "verifier", "gateway"]
    assert cmds["drafter"] == ["/py", "-m", "drafter", "--model", "D", "--host", "127.0.0.1", "--port", "6001",
                               "--metrics-port", "9101", "--device", "cuda:0", "--cpus", "0-1", "--dtype", "float32",
                               "--revision", "v1", "--model-file", "m.gguf"]  # fmt: skip
    assert cmds["gateway"] == ["/py", "-m", "gateway", "--drafter", "127.0.0.1:6001", "--verifier", "127.0.0.1:6002",
                               "--redis-url", REDIS, "--host", "127.0.0.1", "--http-port", "8123",
                               "--grpc-port", "6051",
                               "--drafter-start-wait-s", "900"]  # fmt: skip
    # the same through the dataclass, as benchmarks and tests build it
    assert child_commands(UpConfig(target="T", drafter="D", drafter_dtype="float32", drafter_device="cuda:0",
                                   drafter_cpus=(0, 1), drafter_port=6001, drafter_metrics_port=9101,
                                   drafter_revision="v1", drafter_file="m.gguf", verifier_port=6002, http_port=8123,
                                   grpc_port=6051, redis_url=REDIS, python="/py")) == cmds  # fmt: skip
    # no --drafter: the default drafter, as before; a named single drafter: the same command lines
    assert parse([]) == UpConfig()
    named = parse(["--drafter", "fast=D", "--drafter-dtype", "fast=float32"])
    assert (named.drafter, named.drafter_name, named.drafter_dtype, named.more_drafters) == ("D", "fast", "float32", ())
    assert commands(["--drafter", "fast=D", "--drafter-dtype", "fast=float32"]) == \
        commands(["--drafter", "D", "--drafter-dtype", "float32"])
    assert Stack(UpConfig()).endpoints()["drafter"] == "127.0.0.1:50061"


def test_no_drafter_ignores_the_drafters_and_their_names():
    cfg = parse(["--drafter", "a=A", "--drafter", "b=B", "--no-drafter", "--drafter-dtype", "b=float32"])
    assert (cfg.drafter, cfg.more_drafters, cfg.drafter_dtype) == (None, (), None)
    cmds = child_commands(dataclasses.replace(cfg, redis_url=REDIS))
    assert list(cmds) == ["verifier", "gateway"] and "--drafter" not in cmds["gateway"]


# -- several drafters ---------------------------------------------------------------------------


def test_two_drafters_give_two_children_with_their_ports_names_and_the_gateways_pool(monkeypatch):
    cmds = commands(["--drafter", "qwen2.5-coder-0.5b", "--drafter", "HuggingFaceTB/SmolLM2-135M@main",
                     "--drafter-port", "6001", "--verifier-port", "6002", "--drafter-dtype", "float32"],
                    monkeypatch)  # fmt: skip
    assert list(cmds) == ["drafter-qwen2-5-coder-0-5b", "drafter-smollm2-135m", "verifier", "gateway"]
    a, b = cmds["drafter-qwen2-5-coder-0-5b"], cmds["drafter-smollm2-135m"]
    assert a[1:] == ["-m", "drafter", "--model", "qwen2.5-coder-0.5b", "--host", "127.0.0.1", "--port", "6001",
                     "--dtype", "float32"]  # fmt: skip
    # the next port after the first drafter's that the stack does not use (6002 is the verifier's)
    assert b[1:] == ["-m", "drafter", "--model", "HuggingFaceTB/SmolLM2-135M@main", "--host", "127.0.0.1",
                     "--port", "6003", "--dtype", "float32"]  # fmt: skip
    gw = cmds["gateway"]
    assert gw[3:11] == ["--drafter", "127.0.0.1:6001", "--drafter-name", "qwen2-5-coder-0-5b", "--drafter-pool",
                        "smollm2-135m=127.0.0.1:6003", "--verifier", "127.0.0.1:6002"]  # fmt: skip
    assert gw.count("--drafter") == 1 and gw.count("--drafter-pool") == 1


def test_further_drafters_skip_ports_in_use(monkeypatch):
    busy = {50062, 50063}  # the verifier's, and something else listening here
    monkeypatch.setattr(upconfig, "port_in_use", lambda host, port: port in busy)
    cfg = resolve_ports(parse(["--drafter", "a=A", "--drafter", "b=B", "--drafter", "c=C"]))
    assert [k.port for k in up.drafters(cfg)] == [50061, 50064, 50065]


def test_ports_zero_and_metrics_ports_of_several_drafters(monkeypatch):
    cfg = resolve_ports(parse(["--drafter", "A", "--drafter", "B", "--drafter", "C", "--drafter-port", "0",
                               "--verifier-port", "0", "--http-port", "0", "--grpc-port", "0"]))  # fmt: skip
    kinds = up.drafters(cfg)
    ports = [k.port for k in kinds] + [cfg.verifier_port, cfg.http_port, cfg.grpc_port]
    assert all(ports) and len(set(ports)) == 6  # 0: a free port each
    assert [k.metrics_port for k in kinds] == [0, 0, 0]  # metrics off unless asked for
    cmds = child_commands(dataclasses.replace(cfg, redis_url=REDIS))
    assert all("--metrics-port" not in c for c in cmds.values())
    # metrics on: the first drafter's port, then the next ones that no other service uses
    cmds = commands(["--drafter", "a=A", "--drafter", "b=B", "--drafter", "c=C", "--drafter-metrics-port", "9101",
                     "--verifier-metrics-port", "9102", "--drafter-metrics-port", "c=9200"], monkeypatch)  # fmt: skip
    assert [flag(cmds[f"drafter-{n}"], "--metrics-port") for n in "abc"] == ["9101", "9103", "9200"]
    assert flag(cmds["verifier"], "--metrics-port") == "9102"
    # a NAME=PORT for the first drafter; the second follows it
    cmds = commands(["--drafter", "a=A", "--drafter", "b=B", "--drafter-port", "a=7000"], monkeypatch)
    assert [flag(cmds[f"drafter-{n}"], "--port") for n in "ab"] == ["7000", "7001"]


def test_name_value_flags_apply_to_one_drafter_only(monkeypatch):
    cpu = str(max(os.sched_getaffinity(0)))  # another CPU for b, where there is one
    cmds = commands(["--drafter", "a=A", "--drafter", "b=org/B", "--device", "cpu",
                     "--drafter-dtype", "b=bfloat16", "--drafter-dtype", "float32",  # NAME=VALUE wins in any order
                     "--drafter-device", "b=cuda:1", "--drafter-cpus", "0", "--drafter-cpus", f"b={cpu}",
                     "--drafter-revision", "b=v2", "--drafter-file", "a=x.gguf", "--drafter-port", "b=7000",
                     "--drafter-metrics-port", "a=9101"], monkeypatch)  # fmt: skip
    assert cmds["drafter-a"][3:] == ["--model", "A", "--host", "127.0.0.1", "--port", "50061", "--metrics-port",
                                     "9101", "--device", "cpu", "--cpus", "0", "--dtype", "float32",
                                     "--model-file", "x.gguf"]  # fmt: skip
    assert cmds["drafter-b"][3:] == ["--model", "org/B", "--host", "127.0.0.1", "--port", "7000", "--device",
                                     "cuda:1", "--cpus", cpu, "--dtype", "bfloat16", "--revision", "v2"]  # fmt: skip
    assert flag(cmds["gateway"], "--drafter-pool") == "b=127.0.0.1:7000"
    # the last value given for a drafter wins, like any repeated flag
    cfg = parse(["--drafter", "a=A", "--drafter", "b=B", "--drafter-dtype", "b=float16", "--drafter-dtype",
                 "b=float32"])  # fmt: skip
    assert cfg.more_drafters[0].dtype == "float32" and cfg.drafter_dtype is None


def test_drafter_names(monkeypatch):
    name = up.drafter_name_for
    assert name("qwen2.5-coder-0.5b") == "qwen2-5-coder-0-5b"  # a catalog name
    assert name("Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF:Q4_K_M@v1") == "qwen2-5-coder-0-5b-instruct-gguf"  # Hub id
    assert name("/models/Model_X.Q4_0.gguf") == "model-x-q4-0" and name("./dir/sub/") == "sub"  # paths
    assert name("...") == "drafter" and len(name("x" * 99)) == 40
    # derived names are made unique; explicit ones are kept, the derived ones give way
    cfg = parse(["--drafter", "A", "--drafter", "a", "--drafter", "org/a@v1"])
    assert [k.name for k in up.drafters(cfg)] == ["a", "a-2", "a-3"]
    cfg = parse(["--drafter", "qwen2.5-coder-0.5b", "--drafter", "qwen2-5-coder-0-5b=other"])
    assert [k.name for k in up.drafters(cfg)] == ["qwen2-5-coder-0-5b-2", "qwen2-5-coder-0-5b"]
    cfg = parse(["--drafter", "x" * 45, "--drafter", "x" * 50])
    assert [k.name for k in up.drafters(cfg)] == ["x" * 40, "x" * 38 + "-2"]
    # only a NAME= prefix in the name pattern names a drafter: Hub ids, paths and anything else are models
    for model in ("org/name@rev=1", "./a=b", "Org=x", "/abs/a=b.gguf", "org/name:Q4_0@main"):
        cfg = parse(["--drafter", model])
        assert cfg.drafter == model and cfg.drafter_name is None, model
    cfg = parse(["--drafter", "d-1=org/name:Q4_0@main"])
    assert (cfg.drafter, cfg.drafter_name) == ("org/name:Q4_0@main", "d-1")
    # a revision containing '=' is given to its drafter by name
    cfg = parse(["--drafter", "a=org/a", "--drafter-revision", "a=x=y"])
    assert cfg.drafter_revision == "x=y"


def test_dataclass_with_more_drafters(monkeypatch):
    """What benchmarks would build: the first drafter in the old fields, the others in more_drafters."""
    cfg = UpConfig(drafter="D", drafter_port=6001, more_drafters=(DrafterKind("E", port=6005, metrics_port=9105),
                                                                  DrafterKind("F", name="f")),
                   redis_url=REDIS, python="/py")  # fmt: skip
    monkeypatch.setattr(upconfig, "port_in_use", lambda host, port: False)
    cmds = child_commands(resolve_ports(cfg))
    assert list(cmds)[:3] == ["drafter-d", "drafter-e", "drafter-f"]
    # F names no port: it takes the one after E's; its metrics are off (the default), or follow E's with None
    assert flag(cmds["drafter-e"], "--metrics-port") == "9105" and flag(cmds["drafter-f"], "--port") == "6006"
    assert "--metrics-port" not in cmds["drafter-f"] and "--metrics-port" not in cmds["drafter-d"]
    cfg = dataclasses.replace(cfg, more_drafters=(cfg.more_drafters[0], DrafterKind("F", name="f", metrics_port=None)))
    assert flag(child_commands(resolve_ports(cfg))["drafter-f"], "--metrics-port") == "9106"
    gw = cmds["gateway"]
    assert [gw[i + 1] for i, a in enumerate(gw) if a == "--drafter-pool"] == ["e=127.0.0.1:6005", "f=127.0.0.1:6006"]


# -- bad input ----------------------------------------------------------------------------------


def test_bad_input_is_a_clear_error_naming_the_flag(capsys):
    with pytest.raises(InvalidArgument) as e:
        parse(["--drafter", "a=A", "--drafter", "b=B", "--drafter-dtype", "c=float32"])
    assert e.value.field == "--drafter-dtype"
    assert "no drafter is named 'c'" in str(e.value) and "the drafters are a, b" in str(e.value)
    with pytest.raises(InvalidArgument, match=r"^--drafter-cpus: no drafter is named 'qwen'"):
        parse(["--drafter-cpus", "qwen=0"])  # the default drafter's name is qwen2-5-coder-0-5b
    with pytest.raises(InvalidArgument) as e:
        parse(["--drafter", "a=A", "--drafter", "a=B"])
    assert e.value.field == "--drafter" and "'a' is given twice" in str(e.value)
    with pytest.raises(InvalidArgument) as e:
        parse(["--drafter", "a=A", "--drafter", "b=B", "--drafter-port", "b=6002", "--verifier-port", "6002"])
    assert e.value.field == "--drafter-port" and "6002" in str(e.value) and "--verifier-port" in str(e.value)
    with pytest.raises(InvalidArgument, match="--drafter-metrics-port: port 8000"):
        parse(["--drafter", "a=A", "--drafter", "b=B", "--drafter-metrics-port", "b=8000"])  # the REST port
    for argv, message in [
        (["--drafter", "a="], "argument --drafter: --drafter: 'a=' names drafter 'a' but no model"),
        (["--drafter", " "], "argument --drafter: --drafter: must name a model"),
        (["--drafter-dtype", "a="], "argument --drafter-dtype: --drafter-dtype: 'a=' names drafter 'a' but no value"),
        (["--drafter-port", "b=70000"], "argument --drafter-port: --drafter-port must be in [0, 65535]"),
        (["--drafter-metrics-port", "b=x"], "argument --drafter-metrics-port: --drafter-metrics-port must be an "
                                            "integer"),
        (["--drafter-cpus", "b=zero"], "argument --drafter-cpus: --drafter-cpus: must be a list of CPU numbers"),
    ]:
        err = refused(argv, capsys)
        assert message in err, err


def test_cli_reports_a_bad_name_and_starts_nothing(monkeypatch, capsys):
    monkeypatch.setattr(Stack, "start", lambda self: pytest.fail("started"))
    rc = cli.main(["up", "--drafter", "a=A", "--drafter", "B", "--drafter-device", "z=cuda:0"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "crossdraft: error: --drafter-device: no drafter is named 'z' (in z=cuda:0); the drafters are a, b" in err


def test_child_commands_refuses_bad_dataclasses():
    with pytest.raises(ValueError, match="twice"):
        child_commands(UpConfig(drafter="D", drafter_name="x", more_drafters=(DrafterKind("E", name="x", port=1),),
                                redis_url=REDIS))  # fmt: skip
    with pytest.raises(ValueError, match="drafter name 'X Y'"):
        child_commands(UpConfig(more_drafters=(DrafterKind("E", name="X Y", port=1),), redis_url=REDIS))
    with pytest.raises(ValueError, match="need a first drafter"):
        child_commands(UpConfig(drafter=None, more_drafters=(DrafterKind("E", port=1),), redis_url=REDIS))
    with pytest.raises(ValueError, match=r"drafter\[e\]_port must be resolved"):
        child_commands(UpConfig(more_drafters=(DrafterKind("E"),), redis_url=REDIS))
    with pytest.raises(ValueError, match="distinct"):
        child_commands(UpConfig(more_drafters=(DrafterKind("E", port=50062),), redis_url=REDIS))


# -- the stack: every drafter started, probed, printed ------------------------------------------

GRPC_FAKE = """
import sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
servicer = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
server.add_insecure_port(f"127.0.0.1:{sys.argv[1]}")
server.start()
time.sleep(float(sys.argv[2]))
servicer.set("", health_pb2.HealthCheckResponse.SERVING)
server.wait_for_termination()
"""

HTTP_FAKE = """
import sys, http.server

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _fake_children(monkeypatch, tmp_path, slow: str | None = None):
    grpc_fake, http_fake = tmp_path / "grpc_fake.py", tmp_path / "http_fake.py"
    grpc_fake.write_text(textwrap.dedent(GRPC_FAKE))
    http_fake.write_text(textwrap.dedent(HTTP_FAKE))
    seen = []

    def fake(cfg: UpConfig) -> dict[str, list[str]]:
        real = child_commands(cfg)
        seen.append(real)
        kids = up.drafter_children(cfg)
        out = {c: [sys.executable, str(grpc_fake), str(k.port), "60" if c == slow else "0.2"] for c, k in kids.items()}
        out["verifier"] = [sys.executable, str(grpc_fake), str(cfg.verifier_port), "0.2"]
        out["gateway"] = [sys.executable, str(http_fake), str(cfg.http_port)]
        return out

    monkeypatch.setattr(up, "child_commands", fake)
    return seen


def _cfg(tmp_path) -> UpConfig:
    return UpConfig(drafter="A", drafter_name="a", more_drafters=(DrafterKind("B", name="b", port=0),),
                    http_port=0, grpc_port=0, drafter_port=0, verifier_port=0, redis_url="redis://127.0.0.1:1/0",
                    log_dir=str(tmp_path / "logs"), stop_timeout_s=5)  # fmt: skip


def test_stack_starts_probes_and_prints_every_drafter(monkeypatch, tmp_path):
    seen = _fake_children(monkeypatch, tmp_path)
    out = io.StringIO()
    with Stack(_cfg(tmp_path), out=out) as stack:
        assert list(stack.children) == ["drafter-a", "drafter-b", "verifier", "gateway"]
        stack.wait_ready(timeout_s=30)
        a, b = up.drafters(stack.cfg)
        assert a.port and b.port and a.port != b.port
        assert stack.endpoints()["drafter-a"] == f"127.0.0.1:{a.port}"
        assert stack.endpoints()["drafter-b"] == f"127.0.0.1:{b.port}"
        assert "drafter" not in stack.endpoints()
        assert f"b=127.0.0.1:{b.port}" in seen[0]["gateway"]
        log = out.getvalue()
        assert "drafter-a ready" in log and "drafter-b ready" in log
        assert stack.log_paths["drafter-b"] == tmp_path / "logs" / "drafter-b.log"
        banner = up.banner(stack)
        assert "+ drafters a, b" in banner
        assert f"drafter a  127.0.0.1:{a.port}  (A)" in banner and f"drafter b  127.0.0.1:{b.port}  (B)" in banner


def test_stack_waits_for_every_drafter(monkeypatch, tmp_path):
    _fake_children(monkeypatch, tmp_path, slow="drafter-b")
    stack = Stack(_cfg(tmp_path), out=io.StringIO()).start()
    with pytest.raises(StackError, match=r"not ready after 2s: drafter-b\n"):
        stack.wait_ready(timeout_s=2)
    assert all(p.poll() is not None for p in stack.children.values())  # stopped on the way out
