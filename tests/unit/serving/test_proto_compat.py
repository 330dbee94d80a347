"""The wire contract stays backward compatible with the committed snapshot, and the checker
itself catches breaking edits (negative controls) while accepting additions."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from crossdraft.serving import protocompat


@pytest.fixture(scope="module")
def baseline():
    return protocompat.summarize_protos()


def _edited(tmp_path: Path, filename: str, old: str, new: str) -> dict:
    root = tmp_path / "proto"
    shutil.copytree(protocompat.PROTO_ROOT / "crossdraft", root / "crossdraft")
    path = root / "crossdraft" / "v1" / filename
    text = path.read_text()
    assert text.count(old) == 1, f"edit anchor not found exactly once in {filename}: {old!r}"
    path.write_text(text.replace(old, new))
    return protocompat.summarize_protos(root)


def test_current_protos_match_snapshot(baseline):
    snapshot = protocompat.load_snapshot()
    assert protocompat.check(snapshot, baseline) == []
    # the snapshot is up to date (additions must be recorded with --write)
    assert snapshot == baseline, "run `python -m crossdraft.serving.protocompat --write`"


def test_cli_check_passes():
    assert protocompat.main([]) == 0


BREAKING = [
    pytest.param(
        "drafter.proto",
        "uint32 num_draft_tokens = 4;",
        "uint32 num_draft_tokens = 40;",
        "DraftRequest: field num_draft_tokens = 4 removed (renumbered to 40)",
        id="renumber-field",
    ),
    pytest.param(
        "drafter.proto",
        "uint32 num_draft_tokens = 4;",
        "int64 num_draft_tokens = 4;",
        "DraftRequest: field num_draft_tokens = 4 changed type uint32 -> int64",
        id="change-field-type",
    ),
    pytest.param(
        "drafter.proto",
        "double stop_below = 8;",
        "",
        "DraftRequest: field stop_below = 8 removed",
        id="remove-field",
    ),
    pytest.param(
        "drafter.proto",
        "  double stop_below = 8;",
        "  reserved 8;",
        "DraftRequest: field stop_below = 8 removed",
        id="remove-field-reserving-only-number",
    ),
    pytest.param(
        "verifier.proto",
        "rpc Verify(VerifyRequest) returns (VerifyResponse);",
        "rpc Verify(VerifyRequest) returns (stream VerifyResponse);",
        "rpc crossdraft.v1.VerifierService/Verify server_streaming changed False -> True",
        id="unary-to-streaming",
    ),
    pytest.param(
        "drafter.proto",
        "rpc Commit(CommitRequest) returns (CommitResponse);",
        "",
        "rpc crossdraft.v1.DrafterService/Commit removed",
        id="remove-rpc",
    ),
    pytest.param(
        "common.proto",
        "repeated double probs = 2;",
        "double probs = 2;",
        "SparseDistribution: field probs = 2 changed label repeated -> optional",
        id="repeated-to-singular",
    ),
    pytest.param(
        "gateway.proto",
        "string role = 1; ",
        "string author = 1; ",
        "ChatMessage: field role = 1 renamed to author",
        id="rename-field",
    ),
    pytest.param(
        "verifier.proto",
        "rpc GetVerifierInfo(GetVerifierInfoRequest) returns (GetVerifierInfoResponse);",
        "rpc GetVerifierInfo(GetVerifierInfoRequest) returns (EndVerifierSessionResponse);",
        "rpc crossdraft.v1.VerifierService/GetVerifierInfo output type changed",
        id="change-rpc-output",
    ),
]


@pytest.mark.parametrize("filename,old,new,expected", BREAKING)
def test_breaking_edits_are_reported(tmp_path, baseline, filename, old, new, expected):
    problems = protocompat.check(baseline, _edited(tmp_path, filename, old, new))
    assert any(expected in p for p in problems), problems


def test_cli_check_fails_on_breaking_change(tmp_path, capsys):
    snapshot = tmp_path / "snap.json"
    assert protocompat.main(["--write", "--snapshot", str(snapshot)]) == 0
    _edited(tmp_path, "drafter.proto", "rpc Commit(CommitRequest) returns (CommitResponse);", "")
    rc = protocompat.main(["--proto-root", str(tmp_path / "proto"), "--snapshot", str(snapshot)])
    assert rc == 1
    assert "DrafterService/Commit removed" in capsys.readouterr().err


COMPATIBLE = [
    pytest.param(
        "drafter.proto",
        "  string allowed_key = 9; ",
        "  string allowed_key = 9;\n  uint32 new_field = 99; ",
        id="add-field",
    ),
    pytest.param(
        "common.proto",
        "message ContextCheck {",
        "message Brand { string name = 1; }\nenum Mode { MODE_UNSPECIFIED = 0; }\nmessage ContextCheck {",
        id="add-message-and-enum",
    ),
    pytest.param(
        "verifier.proto",
        "  rpc Verify(VerifyRequest) returns (VerifyResponse);",
        "  rpc Verify(VerifyRequest) returns (VerifyResponse);\n"
        "  rpc VerifyStream(VerifyRequest) returns (stream VerifyResponse);",
        id="add-rpc",
    ),
    pytest.param(
        "drafter.proto",
        "  double stop_below = 8;",
        '  reserved 8;\n  reserved "stop_below";',
        id="remove-field-reserving-number-and-name",
    ),
]


@pytest.mark.parametrize("filename,old,new", COMPATIBLE)
def test_additions_are_compatible(tmp_path, baseline, filename, old, new):
    new_summary = _edited(tmp_path, filename, old, new)
    assert new_summary != baseline
    assert protocompat.check(baseline, new_summary) == []


def test_reusing_a_reserved_number_is_breaking(tmp_path, baseline):
    reserved = _edited(
        tmp_path, "drafter.proto", "  double stop_below = 8;", '  reserved 8;\n  reserved "stop_below";'
    )
    path = tmp_path / "proto" / "crossdraft" / "v1" / "drafter.proto"
    path.write_text(path.read_text().replace("  reserved 8;\n", "  float min_prob = 8;\n"))
    reused = protocompat.summarize_protos(tmp_path / "proto")
    problems = protocompat.check(reserved, reused)
    assert any("reuses a reserved number" in p for p in problems), problems


def test_generated_stubs_list_the_rpcs():
    from crossdraft.v1 import (
        drafter_pb2,
        drafter_pb2_grpc,
        gateway_pb2,
        gateway_pb2_grpc,
        verifier_pb2,
        verifier_pb2_grpc,
    )

    def methods(module, service):
        svc = module.DESCRIPTOR.services_by_name[service]
        return {m.name: (m.client_streaming, m.server_streaming) for m in svc.methods}

    drafter = methods(drafter_pb2, "DrafterService")
    assert drafter["Draft"] == (False, True)
    for name in ("GetDrafterInfo", "SetAllowedTokens", "SyncDrafterSession", "Commit", "EndDrafterSession"):
        assert drafter[name] == (False, False)
    verifier = methods(verifier_pb2, "VerifierService")
    assert verifier["Verify"] == (False, False)
    assert {"GetVerifierInfo", "SyncVerifierSession", "EndVerifierSession"} <= set(verifier)
    gateway = methods(gateway_pb2, "GatewayService")
    assert gateway["Generate"] == (False, True)
    for name in ("CreateSession", "GetSession", "DeleteSession"):
        assert gateway[name] == (False, False)
    # the grpc stubs exist too
    assert hasattr(drafter_pb2_grpc, "DrafterServiceStub")
    assert hasattr(verifier_pb2_grpc, "add_VerifierServiceServicer_to_server")
    assert hasattr(gateway_pb2_grpc, "GatewayServiceServicer")
