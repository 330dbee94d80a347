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
    from crossdraft.policy import DEFAULT_DRAFT_VOCAB

    assert _parse().draft_vocab == DEFAULT_DRAFT_VOCAB
    assert _parse("--draft-vocab", "0").draft_vocab == 0
    assert _parse("--draft-vocab", "32768").draft_vocab == 32768
