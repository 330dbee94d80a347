"""gateway.discovery.colocated with the placement the model servers report (ModelInfo device and
cpus): two servers on one host share hardware unless their CPU sets are disjoint (CPU devices) or
they run on different CUDA devices; a server that does not report its CPUs keeps the hosts' answer."""

from __future__ import annotations

import pytest

from gateway.discovery import Placement, Pool, colocated

V, D = "127.0.0.1:50062", "127.0.0.1:50061"


def infos(v: dict | None, d: dict | None):
    """An info lookup answering for the verifier at V and the drafter at D; counts its calls."""
    table = {("verifier", V): v, ("drafter", D): d}
    calls = []

    def info(kind, addr):
        calls.append((kind, addr))
        return table.get((kind, addr))

    info.calls = calls
    return info


def cpu(*cpus):
    return {"device": "cpu", "cpus": list(cpus)}


def test_disjoint_cpu_sets_are_not_colocated():
    assert not colocated("auto", V, D, infos(cpu(1), cpu(0)))
    assert not colocated("auto", V, D, infos(cpu(2, 3, 4, 5), cpu(0, 1)))


def test_overlapping_cpu_sets_are_colocated():
    assert colocated("auto", V, D, infos(cpu(0, 1), cpu(1)))
    assert colocated("auto", V, D, infos(cpu(0, 1), cpu(0, 1)))  # both unpinned on a 2-CPU host


@pytest.mark.parametrize("v, d", [
    ({"device": "cpu"}, cpu(0)),  # an older verifier: no cpus field
    (cpu(1), {"device": "cpu", "cpus": []}),  # an older drafter (proto3: absent = empty)
    (None, cpu(0)),  # the verifier's info cannot be fetched
    (cpu(1), None),
])
def test_missing_cpus_keep_the_hosts_answer(v, d):
    assert colocated("auto", V, D, infos(v, d))


def test_cuda_devices():
    both = [0, 1]  # the same CPUs: the devices decide
    assert not colocated("auto", V, D, infos({"device": "cuda:1", "cpus": both}, {"device": "cuda:0", "cpus": both}))
    assert not colocated("auto", V, D, infos({"device": "cuda:1"}, {"device": "cuda"}))  # "cuda" = cuda:0
    assert colocated("auto", V, D, infos({"device": "cuda:0"}, {"device": "cuda"}))
    assert colocated("auto", V, D, infos({"device": "cuda:0", "cpus": [1]}, {"device": "cuda:0", "cpus": [0]}))
    # one on a CUDA device, one on CPUs: today's answer (the host decides)
    assert colocated("auto", V, D, infos({"device": "cuda:0", "cpus": [1]}, cpu(0)))


def test_yes_no_and_other_hosts_ask_nothing():
    info = infos(cpu(1), cpu(0))
    assert colocated("yes", V, D, info) and not colocated("no", V, D, info)
    assert not colocated("auto", "verifier.ns.svc:50051", "drafter.ns.svc:50051", info)
    assert not colocated("auto", V, None, info)
    assert info.calls == []
    assert not colocated("auto", V, D, info) and info.calls == [("verifier", V), ("drafter", D)]
    # no lookup: the hosts alone decide (today's answer)
    assert colocated("auto", V, D)


class _Client:
    def __init__(self, addr, info=None, fail=False):
        self.addr, self._info, self.fail = addr, info, fail

    def info(self):
        if self.fail:
            raise ConnectionError("down")
        return self._info


def test_placement_info_is_the_clients_info_or_none():
    made = {"verifier": lambda a: _Client(a, cpu(1)), "drafter": lambda a: _Client(a, fail=True)}
    pl = Placement(Pool("verifier", [V]), Pool("drafter", [D]), made["verifier"], made["drafter"])
    assert pl.info("verifier", V) == cpu(1)
    assert pl.info("drafter", D) is None  # a server that does not answer
    assert pl.info("drafter", None) is None
    assert colocated("auto", V, D, pl.info)  # the drafter did not say: the hosts decide
