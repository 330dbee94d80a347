"""Each model on its own CPUs: the CPU-list flags (crossdraft.argtypes), a model server's --cpus
(affinity and torch threads, set before its model loads) and the CPU set it reports in ModelInfo."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap

import pytest

from crossdraft.argtypes import cpu_list_arg, format_cpu_list, parse_cpu_list
from crossdraft.errors import InvalidArgument
from crossdraft.serving import modelserver, wire

pytestmark = pytest.mark.timeout(300)

EIGHT = range(8)  # a host with CPUs 0-7


@pytest.mark.parametrize("text, cpus", [
    ("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0,2,4-5", (0, 2, 4, 5)), (" 5 , 1-2 ", (1, 2, 5)), ("3,3,2-3", (2, 3)),
    ("7", (7,)), ("0 - 1", (0, 1)),
])
def test_cpu_lists(text, cpus):
    assert parse_cpu_list(text, "--cpus", EIGHT) == cpus


@pytest.mark.parametrize("text, message", [
    ("", "--cpus: must name at least one CPU"),
    ("  ", "--cpus: must name at least one CPU"),
    ("-1", "--cpus: CPU numbers must be >= 0, got '-1'"),
    ("0,-2", "--cpus: CPU numbers must be >= 0, got '0,-2'"),
    ("2--1", "--cpus: CPU numbers must be >= 0"),
    ("x", "--cpus: must be a list of CPU numbers and ranges like 0, 0-3 or 0,2,4-5, got 'x'"),
    ("0,,1", "--cpus: must be a list of CPU numbers"),
    ("1.5", "--cpus: must be a list of CPU numbers"),
    ("0-", "--cpus: must be a list of CPU numbers"),
    ("0x1", "--cpus: must be a list of CPU numbers"),
    ("3-1", "--cpus: a range must run from low to high, got '3-1'"),
    ("8", "--cpus: CPU 8 is not available here: this process may use CPUs 0-7, got '8'"),
    ("6-9,12", "--cpus: CPUs 8-9,12 are not available here"),
    ("0-99999999999", "--cpus: CPUs 8-99999999999 are not available here"),  # refused, never spelled out
])
def test_bad_cpu_lists_name_the_flag(text, message):
    with pytest.raises(InvalidArgument) as e:
        parse_cpu_list(text, "--cpus", EIGHT)
    assert e.value.field == "--cpus" and message in str(e.value)


def test_cpus_outside_this_process_affinity_are_refused():
    assert parse_cpu_list("2,4", "x", {0, 2, 4}) == (2, 4)
    with pytest.raises(InvalidArgument, match=r"CPUs 1,3 are not available here: this process may use CPUs 0,2,4"):
        parse_cpu_list("1-3", "x", {0, 2, 4})
    have = sorted(os.sched_getaffinity(0))  # the default: this process's own set
    assert parse_cpu_list(format_cpu_list(have)) == tuple(have)
    with pytest.raises(InvalidArgument, match="not available here"):
        parse_cpu_list(str(have[-1] + 1))


def test_format_cpu_list():
    assert format_cpu_list([]) == ""
    assert format_cpu_list({5, 0, 1, 2, 7, 8}) == "0-2,5,7-8"
    assert format_cpu_list([3]) == "3"
    assert parse_cpu_list(format_cpu_list([0, 2, 3, 4, 7]), "x", EIGHT) == (0, 2, 3, 4, 7)


def test_cpu_list_arg_names_flag_and_env():
    with pytest.raises(argparse.ArgumentTypeError, match=r"^--cpus: CPU 9 is not available .* \(the flag or env "
                                                           r"CROSSDRAFT_CPUS\)$"):
        cpu_list_arg("--cpus", env="CROSSDRAFT_CPUS", available=EIGHT)("9")
    assert cpu_list_arg("--drafter-cpus", available=EIGHT)("1-2") == (1, 2)


def _server_parser():
    p = argparse.ArgumentParser(prog="python -m drafter")
    modelserver.add_arguments(p, 50061)
    return p


def test_model_server_cpus_flag_and_env(monkeypatch, capsys):
    monkeypatch.delenv("CROSSDRAFT_CPUS", raising=False)
    cfg = modelserver.config_from_args(_server_parser().parse_args(["--model", "m"]))
    assert cfg.cpus == ()  # unpinned by default
    cfg = modelserver.config_from_args(_server_parser().parse_args(["--model", "m", "--cpus", "0"]))
    assert cfg.cpus == (0,)
    monkeypatch.setenv("CROSSDRAFT_CPUS", "0")
    assert modelserver.config_from_args(_server_parser().parse_args(["--model", "m"])).cpus == (0,)
    for argv, env, message in [
        (["--cpus", "-1"], None, "argument --cpus: --cpus: CPU numbers must be >= 0"),
        (["--cpus", "all"], None, "argument --cpus: --cpus: must be a list of CPU numbers"),
        ([], "100000", "--cpus: CPU 100000 is not available here"),
        ([], "0-", "must be a list of CPU numbers"),
    ]:
        monkeypatch.setenv("CROSSDRAFT_CPUS", env or "0")
        with pytest.raises(SystemExit) as e:
            _server_parser().parse_args(["--model", "m", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "(the flag or env CROSSDRAFT_CPUS)" in err, err


def test_model_info_reports_the_process_cpus():
    info = dict(model_name="m", device="cpu")
    m = wire.model_info_to_proto(info)
    assert list(m.cpus) == sorted(os.sched_getaffinity(0)) and "cpus" not in info
    assert wire.model_info_from_proto(m)["cpus"] == sorted(os.sched_getaffinity(0))
    assert list(wire.model_info_to_proto(dict(info, cpus=[3])).cpus) == [3]
    assert wire.model_info_from_proto(wire.common_pb2.ModelInfo(model_name="old"))["cpus"] == []  # an older server


def test_pin_cpus_pins_every_thread_and_sizes_torch():
    """In a fresh interpreter (pinning is for the whole process): a thread started before the pin
    is pinned too, and torch runs one intra-op and one inter-op thread per CPU."""
    cpu = min(os.sched_getaffinity(0))
    code = textwrap.dedent(f"""
        import os, threading
        ev = threading.Event()
        t = threading.Thread(target=ev.wait); t.start()
        from crossdraft.serving.modelserver import pin_cpus
        print(pin_cpus(()))
        print(pin_cpus([{cpu}]))
        import torch
        print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(t.native_id)),
              torch.get_num_threads(), torch.get_num_interop_threads())
        ev.set()
    """)
    env = dict(os.environ, OMP_NUM_THREADS="2")  # --cpus decides the thread count, not the environment
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["None", "(1, 1)", f"[{cpu}] [{cpu}] 1 1"]


# ---- real model servers --------------------------------------------------------------------------


def _allowed(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of process `pid`."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                out |= {ln.split(":", 1)[1].strip() for ln in f if ln.startswith("Cpus_allowed_list")}
        except OSError:  # a thread that ended meanwhile
            pass
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_servers_on_their_own_cpus_report_them_and_are_not_colocated(tmp_path):
    """A drafter started with --cpus 0 and a verifier with --cpus 1 (tiny real models, loopback):
    every thread of each is pinned to its CPU, each runs 1 torch thread (its startup line), each
    reports its set in ModelInfo, and the gateway's --colocated auto says they do not share."""
    from gateway.clients import RemoteDrafter, RemoteVerifier
    from gateway.discovery import Placement, Pool, colocated
    from tests.service_fixtures import model_server, save_tiny_pair, wait_grpc_healthy

    c0, c1 = sorted(os.sched_getaffinity(0))[:2]
    t_dir, d_dir = save_tiny_pair(tmp_path / "models")
    procs = []
    try:
        (dp, d_addr) = model_server("drafter", str(d_dir), tmp_path, extra=["--cpus", str(c0)])
        procs.append(dp)
        (vp, v_addr) = model_server("verifier", str(t_dir), tmp_path, extra=["--cpus", str(c1)])
        procs.append(vp)
        for p, addr in ((dp, d_addr), (vp, v_addr)):
            wait_grpc_healthy(addr, p)
        pl = Placement(Pool("verifier", [v_addr]), Pool("drafter", [d_addr]), RemoteVerifier, RemoteDrafter)
        try:
            assert pl.info("drafter", d_addr)["cpus"] == [c0]
            assert pl.info("verifier", v_addr)["cpus"] == [c1]
            assert not colocated("auto", v_addr, d_addr, pl.info)
            assert colocated("auto", v_addr, d_addr)  # the hosts alone: today's answer
        finally:
            for c in pl.clients.values():
                c.close()
        assert _allowed(dp.p.pid) == {str(c0)} and _allowed(vp.p.pid) == {str(c1)}
        for p, c in ((dp, c0), (vp, c1)):
            assert f"pinned to CPUs {c}; torch threads: 1 intra-op, 1 inter-op" in p.tail(20000), p.tail()
    finally:
        for p in procs:
            p.stop()
