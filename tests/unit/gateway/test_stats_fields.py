"""A request's stats say the same through both front ends: every key of the REST reply's stats
(gateway.metrics.stats_dict) is a field of the gRPC SpeculativeStats message, and the other way round,
and a stats dict converts with every value kept (gateway.service.stats_to_proto)."""

from __future__ import annotations

from crossdraft.decoding.stats import Stats
from crossdraft.v1 import gateway_pb2
from gateway.metrics import stats_dict
from gateway.service import stats_to_proto


def test_rest_and_grpc_stats_have_the_same_fields():
    rest = set(stats_dict(Stats()))
    grpc = set(gateway_pb2.SpeculativeStats.DESCRIPTOR.fields_by_name)
    assert rest == grpc, (sorted(rest - grpc), sorted(grpc - rest))


def test_stats_convert_to_the_grpc_message_value_for_value():
    s = Stats(mode="speculative", draft_mode="text", rounds=7, drafted=9, accepted=4, skipped_rounds=3,
              caught_up=1, elided=41, branches=2, branch_blocks=1, drafter="small", draft_s=0.25)
    d = stats_dict(s)
    msg = stats_to_proto(d)
    for k, v in d.items():
        got = getattr(msg, k)
        assert (list(got) if k == "acceptance_by_position" else got) == v, k
    assert msg.elided == 41 and msg.draft_ms == 250.0
