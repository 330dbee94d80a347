"""The CLI's option parsing: numbers are checked where they are read, and errors name the option."""

from __future__ import annotations

import pytest

from crossdraft import cli
from crossdraft.errors import InvalidArgument


def _parse(*extra):
    return cli.build_parser().parse_args(["generate", "--prompt", "x", *extra])


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--num-draft-tokens", "-2"], "--num-draft-tokens must be >= 1, got -2"),
    (["--top-k", "-1"], "--top-k must be >= 0, got -1"),
    (["--seed", "-5"], "--seed must be >= 0, got -5"),
    (["--seed", "x"], "--seed must be an integer, got 'x'"),
    (["--stop-cumulative", "often"], "--stop-cumulative must be a number"),
    (["--draft-vocab", "-1"], "--draft-vocab must be >= 0, got -1"),
])
def test_bad_numbers_are_refused_naming_the_option(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        _parse(*args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_zero_is_a_value_where_zero_means_off():
    a = _parse("--seed", "0", "--top-k", "0", "--stop-cumulative", "0")
    params, draft = cli._sampling_from_args(a)
    assert a.seed == 0 and params.top_k == 0 and draft.stop_cumulative == 0.0


def test_the_cumulative_stop_defaults_to_the_cost_model_and_is_range_checked():
    _, draft = cli._sampling_from_args(_parse())
    assert draft.stop_cumulative is None
    _, draft = cli._sampling_from_args(_parse("--stop-cumulative", "0.4"))
    assert draft.stop_cumulative == 0.4
    with pytest.raises(InvalidArgument, match="stop_cumulative"):
        cli._sampling_from_args(_parse("--stop-cumulative", "1.5"))


def test_the_draft_vocabulary_defaults_to_the_policy_constant():
    from crossdraft.decoding.policy import DEFAULT_DRAFT_VOCAB

    assert _parse().draft_vocab == DEFAULT_DRAFT_VOCAB
    assert _parse("--draft-vocab", "0").draft_vocab == 0
    assert _parse("--draft-vocab", "32768").draft_vocab == 32768


# ---- every integer flag of every command names itself when refused -----------------------------


def _refused(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["request", "--prompt", "x", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["request", "--prompt", "x", "--seed", str(2**63)], f"--seed must be <= {2**63 - 1}"),
    (["request", "--prompt", "x", "--seed", "1e3"], "--seed must be an integer, got '1e3'"),
    (["generate", "--prompt", "x", "--seed", str(2**63)], f"--seed must be <= {2**63 - 1}"),
])
def test_seeds_stay_below_two_to_the_63(capsys, argv, message):
    assert message in _refused(cli.build_parser().parse_args, argv, capsys)
    ok = cli.build_parser().parse_args([*argv[:-1], str(2**63 - 1)])
    assert ok.seed == 2**63 - 1


def test_up_refuses_a_demo_without_tokens(capsys):
    err = _refused(cli.build_parser().parse_args, ["up", "--demo-max-tokens", "0"], capsys)
    assert "--demo-max-tokens must be >= 1, got 0" in err


_MODEL_SERVER_FLAGS = [
    ("--port", "70000", "must be in [0, 65535]"),
    ("--max-sessions", "0", "must be >= 1, got 0"),
    ("--session-ttl-s", "0", "must be > 0"),
    ("--metrics-port", "-1", "must be in [0, 65535] (0 = off)"),
    ("--max-workers", "0", "must be >= 1, got 0"),
    ("--max-workers", "many", "must be an integer, got 'many'"),
    ("--max-batch-rows", "0", "must be >= 1"),
    ("--max-batch-tokens", "0", "must be >= 1"),
    ("--prefill-chunk", "0", "must be >= 1"),
    ("--kv-cache-tokens", "-1", "must be >= 0"),
    ("--kv-cache-memory-fraction", "1.5", "must be <= 1"),
    ("--health-port", "65536", "must be in [0, 65535]"),
]


def _model_server_parser():
    import argparse

    from crossdraft.serving import modelserver

    p = argparse.ArgumentParser(prog="python -m drafter")
    modelserver.add_arguments(p, 50052)
    return p


@pytest.mark.parametrize("flag, value, message", _MODEL_SERVER_FLAGS)
def test_model_server_integer_flags_name_themselves(capsys, monkeypatch, flag, value, message):
    err = _refused(_model_server_parser().parse_args, ["--model", "m", flag, value], capsys)
    assert f"argument {flag}: {flag} {message}" in err
    # the same value from the environment is refused the same way, naming the variable
    env = "CROSSDRAFT_" + flag[2:].upper().replace("-", "_")
    monkeypatch.setenv(env, value)
    err = _refused(_model_server_parser().parse_args, ["--model", "m"], capsys)
    assert message in err and env in err


_GATEWAY_FLAGS = [
    ("--http-port", "-1", "must be in [0, 65535]"),
    ("--grpc-port", "65536", "must be in [0, 65535]"),
    ("--session-ttl-s", "0", "must be > 0"),
    ("--drafter-timeout-s", "-1", "must be > 0"),
    ("--draft-vocab", "-1", "must be >= 0"),
    ("--max-new-tokens-limit", "0", "must be >= 1"),
    ("--default-max-new-tokens", "zero", "must be an integer"),
    ("--default-temperature", "nan", "must be a finite number"),
    ("--max-concurrent-requests", "0", "must be >= 1"),
    ("--max-queued-requests", "-1", "must be >= 0"),
    ("--queue-timeout-s", "-0.5", "must be >= 0"),
    ("--stale-pairing-restart-s", "-1", "must be >= 0"),
    ("--drain-timeout-s", "-1", "must be >= 0"),
    ("--drafter-start-wait-s", "-1", "must be >= 0"),
]


@pytest.mark.parametrize("flag, value, message", _GATEWAY_FLAGS)
def test_gateway_numeric_flags_name_themselves(capsys, flag, value, message):
    from gateway.server import build_parser

    err = _refused(build_parser().parse_args, ["--verifier", "v:1", "--redis-url", "redis://r", flag, value], capsys)
    assert f"argument {flag}: {flag} {message}" in err


def test_model_server_defaults_parse_to_numbers():
    a = _model_server_parser().parse_args(["--model", "m"])
    assert (a.port, a.max_sessions, a.metrics_port, a.max_workers, a.health_port) == (50052, 64, 0, 64, 0)
    assert isinstance(a.session_ttl_s, float) and isinstance(a.kv_cache_memory_fraction, float)


def test_gateway_flags_in_range_reach_the_config():
    from gateway.server import build_parser, config_from_args

    a = build_parser().parse_args(["--verifier", "x:1", "--redis-url", "redis://x", "--draft-vocab", "4096",
                                   "--max-queued-requests", "0", "--stale-pairing-restart-s", "0",
                                   "--drafter-start-wait-s", "0"])
    cfg = config_from_args(a)
    assert cfg.draft_vocab == 4096 and cfg.drafter_start_wait_s == 0.0
    assert (a.max_queued_requests, a.stale_pairing_restart_s) == (0, 0.0)
