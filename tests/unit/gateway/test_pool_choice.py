"""A request's choice among a pool of drafter kinds (gateway/pool.py PoolChoice, prior_order, parse_named).

The chooser is driven round by round with what each round showed (drafted, accepted, the kind's policy's
value); `switch` stands for the gateway's move to a kind's Decoder (no model servers here: the decoding
side of a move has its own tests, tests/unit/decoding/test_hand_over.py). The properties checked: a kind
whose drafts fail is left for one not yet measured; a kind that drafts well is kept; measured kinds are
compared by value with hysteresis; a failed drafter fails over; estimates carry over to the next turn."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from crossdraft.decoding.stats import Stats
from crossdraft.errors import InvalidArgument
from gateway import pool as P


class Req:
    """What PoolChoice reads of a request: its policy's value, whether it drafts, its stats, its drafter view."""

    def __init__(self, value: float = 2.0):
        self.val = value
        self.policy = SimpleNamespace(value=lambda alpha=None, usual_speed=False: self.val)
        self.spec = True
        self.stats = Stats()
        self.d = object()


def ev(drafted: int, accepted: int, skip: str = ""):
    return SimpleNamespace(drafted=drafted, accepted=accepted, skip_reason=skip)


def chooser(order, estimates=None, down=()):
    moves = []

    def switch(name):
        moves.append(name)
        return None if name in down else f"decoder-{name}"

    pc = P.PoolChoice(order, estimates, switch)
    pc.started(pc.first()[0])
    return pc, moves


def drive(pc, req, rounds, value_of=None):
    """Run rounds (drafted, accepted) through the chooser, following its moves; the kinds each round ran on."""
    seen = []
    for d, a in rounds:
        seen.append(pc.current)
        if value_of is not None:  # (each kind's rounds are priced by that kind's own policy)
            req.val = value_of[pc.current]
            req.policy = SimpleNamespace(value=lambda alpha=None, usual_speed=False, v=req.val: v)
        pc(req, ev(d, a))
    return seen


def test_a_kind_that_cannot_draft_is_left_for_an_untried_one_within_a_few_rounds():
    pc, moves = chooser(["english", "multilingual"])
    req = Req()
    seen = drive(pc, req, [(4, 0)] * 3 + [(4, 4)] * 10, value_of={"english": 1.0, "multilingual": 2.5})
    assert seen[0] == "english" and pc.current == "multilingual"
    assert seen.index("multilingual") <= P.DWELL  # left as soon as it has been measured and dwelt
    assert moves == ["multilingual"] and req.stats.drafter_choice == "explore"
    snap = pc.snapshot()
    assert snap["english"]["v"] == 1.0 and snap["multilingual"]["v"] == 2.5
    assert snap["english"]["s"] == 0.0 and snap["multilingual"]["s"] > 0


def test_a_kind_that_drafts_well_is_kept_without_exploring():
    pc, moves = chooser(["same-family", "tiny"])
    req = Req(3.0)
    drive(pc, req, [(4, 4)] * 12)
    assert moves == [] and pc.current == "same-family"


def test_measured_kinds_are_compared_by_value_with_hysteresis():
    est = {"a": {"s": 3.0, "t": 4.0, "n": 5, "v": 2.0}, "b": {"s": 3.0, "t": 4.0, "n": 5, "v": 2.1}}
    pc, moves = chooser(["a", "b"], est)
    assert pc.current == "b"  # the better measured kind first
    req = Req()
    # within the margin of each other: no flapping either way
    drive(pc, req, [(4, 3)] * 8, value_of={"a": 2.0, "b": 2.1 / P.MARGIN * 1.01})
    assert moves == []
    # b's acceptance falls: its value drops below a's by more than the margin -> a
    drive(pc, req, [(4, 0)] * 4, value_of={"a": 2.0, "b": 1.2})
    assert moves == ["a"] and req.stats.drafter_choice == "exploit"


def test_a_failed_drafter_fails_over_to_another_kind_and_skips_one_without_replicas():
    pc, moves = chooser(["a", "b", "c"], down={"b"})
    req = Req()
    pc(req, ev(4, 3))
    req.spec, req.stats.drafter_fallback = False, True  # (Decoder: the drafter's call failed)
    assert pc(req, ev(0, 0)) == "decoder-c"
    assert moves == ["b", "c"] and pc.current == "c" and pc.down == {"a", "b"}
    assert req.stats.drafter_fallback is False and req.stats.drafter_choice == "failover"
    # the last one fails too: nothing left, the request goes on target-only
    req.spec, req.stats.drafter_fallback = False, True
    assert pc(req, ev(0, 0)) is None and pc.current == "c"


def test_no_kind_that_pays_is_reported_as_none_and_kept_without_moves():
    est = {"a": {"s": 0.0, "t": 5.0, "n": 5, "v": 1.0}, "b": {"s": 0.1, "t": 5.0, "n": 5, "v": 1.0}}
    pc, moves = chooser(["a", "b"], est)
    req = Req(1.0)
    for _ in range(P.DWELL + 2):
        pc(req, ev(0, 0, "acceptance"))
    assert moves == [] and req.stats.drafter_choice == "none"


def test_a_new_turn_starts_on_the_best_measured_kind_and_explores_unmeasured_ones_before_poor_ones():
    est = {"poor": {"s": 0.0, "t": 4.0, "n": 4, "v": 1.0}, "good": {"s": 3.0, "t": 4.0, "n": 4, "v": 1.8}}
    assert P.PoolChoice(["poor", "new", "good"], est, None).first() == ["good", "new", "poor"]
    # estimates of kinds the gateway no longer has are dropped
    assert P.PoolChoice(["new"], est, None).first() == ["new"]


def request_of(priors, cls, order, values, rounds=12):
    """One new session of class `cls` through the chooser with the gateway's priors (PoolPriors): each round
    drafts 4 and accepts per the kind's value; returns (the kinds its rounds ran on, the moves)."""
    moves = []
    pc = P.PoolChoice(order, None, lambda n: moves.append(n) or f"decoder-{n}", prior=priors.seed(cls))
    pc.started(pc.first()[0], "prior" if pc.prior else "start")
    req = Req()
    seen = drive(pc, req, [(4, 4 if values[pc.current] > 1.5 else 1)] * rounds, value_of=values)
    priors.learn(cls, pc.learned())
    return seen, moves


def test_similar_requests_start_on_the_kind_their_class_measured_best_without_exploring():
    priors = P.PoolPriors()
    code = {"tiny": 1.3, "family": 2.2}  # where the second kind is best, the first request explores to find it
    seen, moves = request_of(priors, "latin/code", ["tiny", "family"], code)
    assert seen[0] == "tiny" and moves == ["family"]
    for _ in range(3):  # the next ones of the class start there and stay
        seen, moves = request_of(priors, "latin/code", ["tiny", "family"], code)
        assert set(seen) == {"family"} and moves == []
    # another class learns apart: its first request starts from the prompt's spelling, as before
    seen, moves = request_of(priors, "latin/prose", ["tiny", "family"], {"tiny": 1.3, "family": 1.1})
    assert seen[0] == "tiny"
    assert set(priors.snapshot()) == {"latin/code", "latin/prose"}


def test_a_session_whose_own_rounds_contradict_its_class_leaves_the_kind_the_prior_chose():
    priors = P.PoolPriors()
    request_of(priors, "latin/code", ["tiny", "family"], {"tiny": 1.3, "family": 2.2})
    # this session's text suits the tiny kind: its rounds on "family" measure less than the class's tiny
    seen, moves = request_of(priors, "latin/code", ["tiny", "family"], {"tiny": 2.0, "family": 1.05})
    assert seen[0] == "family" and seen[-1] == "tiny" and moves == ["tiny"]


def test_a_kind_its_class_stopped_measuring_is_explored_again():
    priors = P.PoolPriors()
    values = {"tiny": 1.3, "family": 2.2}
    request_of(priors, "latin/code", ["tiny", "family"], values)
    # "family" keeps winning, so later requests never measure "tiny": its estimate grows stale and is dropped,
    # after which a request that finds "family" poor explores "tiny" instead of trusting an old number
    for _ in range(40):
        if "tiny" not in priors.snapshot()["latin/code"]:
            break
        request_of(priors, "latin/code", ["tiny", "family"], values)
    else:
        pytest.fail("the unmeasured kind's estimate never expired")
    seen, moves = request_of(priors, "latin/code", ["tiny", "family"], {"tiny": 1.3, "family": 1.0})
    assert seen[0] == "family" and moves == ["tiny"]


def test_a_class_where_no_kind_pays_runs_target_only_until_its_estimates_expire():
    """Every kind measured by the class's requests at 1.0 (none worth drafting): a new session of the class
    chooses none up front (target-only, no drafter touched); each such request ages the estimates, and once
    they expire a request of the class measures the kinds again -- and, the text now draftable, drafts."""
    priors = P.PoolPriors()
    order = ["tiny", "family"]
    seen, moves = request_of(priors, "cjk/prose", order, {"tiny": 1.0, "family": 1.0})
    assert seen[0] == "tiny" and moves == ["family"]  # the first request explores both
    runs = 0
    while P.PoolChoice(order, None, None, prior=priors.seed("cjk/prose")).none_pays():
        runs += 1
        priors.age("cjk/prose")  # (what a request that ran target-only by its class does at its end)
        assert runs <= P.STALE, "the class's estimates never expired"
    assert runs == P.STALE  # (a kind its class has not measured in STALE requests is dropped)
    seen, moves = request_of(priors, "cjk/prose", order, {"tiny": 1.0, "family": 2.0})
    assert seen[-1] == "family" and priors.snapshot()["cjk/prose"]["family"]["v"] == 2.0
    # not where a kind is unmeasured, down for the request, or worth drafting; nor for a session's own estimates
    measured = {"s": 0.0, "t": 4.0, "n": 4, "v": 1.0}
    assert not P.PoolChoice(["a", "b"], None, None, prior={"a": measured}).none_pays()
    both = P.PoolChoice(["a", "b"], None, None, prior={"a": measured, "b": dict(measured, v=1.4)})
    assert not both.none_pays()
    both.down.add("b")
    assert both.none_pays()
    assert not P.PoolChoice(["a"], {"a": measured}, None).none_pays()


class PricedReq(Req):
    """A request whose policy prices a block at any acceptance: worth 2.0 from 50% acceptance, else 1.0
    (nothing pays); without an acceptance, at its own latest estimate (``val``)."""

    def __init__(self, value: float = 2.0):
        super().__init__(value)
        self.policy = SimpleNamespace(value=lambda alpha=None, usual_speed=False: self.val if alpha is None else
                                      (2.0 if alpha >= 0.5 else 1.0))


def one_kind_request(priors, rounds):
    """A new session of class "cjk/prose" on a gateway with one drafter kind: None where its class's
    estimates send it target-only (none_pays), else it runs `rounds` ((drafted, accepted, skip reason, its
    policy's latest value)) and teaches the class."""
    pc = P.PoolChoice(["only"], None, lambda n: None, prior=priors.seed("cjk/prose"))
    if pc.none_pays():
        priors.age("cjk/prose")
        return None
    pc.started("only", "prior" if pc.prior else "start")
    req = PricedReq()
    for d, a, skip, v in rounds:
        req.val = v
        assert pc(req, ev(d, a, skip)) is None  # (nothing to move to)
    priors.learn("cjk/prose", pc.learned())
    return pc


def test_one_drafter_kind_learns_its_prompt_classes_from_the_whole_request():
    """A gateway with a single drafter learns what it is worth per prompt class as a pool does, priced at
    each request's acceptance over all of its drafted rounds: a request that drafted well and whose last
    rounds stopped on a hard stretch (skip "acceptance") says drafting pays for its class; a hopeless one
    whose last probe came true says it does not, and the class's next new sessions run target-only until
    its estimate expires."""
    priors = P.PoolPriors()
    good = [(4, 4, "", 2.4)] * 6 + [(4, 0, "", 1.0)] + [(0, 0, "acceptance", 1.0)] * 3
    pc = one_kind_request(priors, good)
    assert pc.snapshot()["only"]["v"] == 1.0  # (its latest rounds: nothing pays now)
    assert priors.snapshot()["cjk/prose"]["only"]["v"] == 2.0  # (the request: 24 of 25 accepted)
    assert one_kind_request(priors, good) is not None  # the class pays: the next one drafts
    priors = P.PoolPriors()
    hopeless = [(2, 0, "", 1.0)] + [(0, 0, "acceptance", 1.0)] * 6 + [(1, 0, "", 1.0)] + \
        [(0, 0, "acceptance", 1.0)] * 6 + [(1, 1, "", 1.6)]
    pc = one_kind_request(priors, hopeless)
    assert pc.snapshot()["only"]["v"] == 1.6 and priors.snapshot()["cjk/prose"]["only"]["v"] == 1.0
    skipped = 0
    while one_kind_request(priors, good) is None:
        skipped += 1
        assert skipped <= P.STALE
    assert skipped == P.STALE  # then measured again: the text turned draftable, and the class learns it
    assert priors.snapshot()["cjk/prose"]["only"]["v"] == 2.0
    # rounds that skipped because the drafter is slow now (busy: the moment's, as the load) teach nothing
    busy = one_kind_request(priors, [(0, 0, "drafter busy", 1.0)] * 8)
    assert busy.learned() == {} and priors.snapshot()["cjk/prose"]["only"]["v"] == 2.0


@pytest.fixture(scope="module")
def shared_redis():
    """A real redis-server, as the gateways' session store uses."""
    import redis

    from crossdraft.serving.redis_server import RedisServer

    srv = RedisServer().start()
    try:
        yield redis.Redis.from_url(srv.url)
    finally:
        srv.stop()


def test_gateway_replicas_sharing_redis_learn_from_each_others_requests(shared_redis):
    """Two gateways of one target (PoolPriors on the same Redis key): what a request on one measured starts
    the other's new sessions of that class on the kind it found best; a replica of another pool whose kind of
    the same name serves another model ignores those estimates."""
    key = "crossdraft:pool-priors:test-share"
    a, b = P.PoolPriors(shared_redis, key), P.PoolPriors(shared_redis, key)
    code = {"tiny": 1.3, "family": 2.2}
    seen, moves = request_of(a, "latin/code", ["tiny", "family"], code)
    assert seen[0] == "tiny" and moves == ["family"]  # the first request anywhere explores
    seen, moves = request_of(b, "latin/code", ["tiny", "family"], code)
    assert set(seen) == {"family"} and moves == []  # the other replica starts where the first ended
    assert b.snapshot() == a.snapshot() and set(a.snapshot()) == {"latin/code"}
    models = {"tiny": "m-tiny", "family": "m-family"}
    a.learn("latin/prose", {"family": {"s": 3.0, "t": 4.0, "n": 4, "v": 2.0}}, models)
    assert set(b.seed("latin/prose", models)) == {"family"}
    assert b.seed("latin/prose", {"tiny": "m-tiny", "family": "another-model"}) == {}


def test_concurrent_updates_from_replicas_are_none_of_them_lost(shared_redis):
    """Twelve requests on two replicas finish at once, each having measured its own kind: every kind is in
    the class's estimates once they are done, and each aged by the requests after it (ages 0..5 per six)."""
    import threading

    key = "crossdraft:pool-priors:test-race"
    replicas = [P.PoolPriors(shared_redis, key), P.PoolPriors(shared_redis, key)]
    kinds = [f"k{i}" for i in range(P.STALE - 2)]
    go = threading.Barrier(len(kinds))

    def one(i):
        go.wait()
        replicas[i % 2].learn("latin/code", {kinds[i]: {"s": 1.0, "t": 2.0, "n": 2, "v": 1.0 + i}})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(kinds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    doc = replicas[0].snapshot()["latin/code"]
    assert set(doc) == set(kinds)
    assert sorted(p["age"] for p in doc.values()) == list(range(len(kinds)))
    assert all(doc[k]["v"] == 1.0 + i for i, k in enumerate(kinds))


def test_priors_without_redis_answering_use_the_gateways_own_memory():
    """Redis down (nothing listens on its port): requests neither fail nor wait on it; the gateway learns and
    seeds from its own memory meanwhile."""
    import redis

    from tests.service_fixtures import free_port

    down = redis.Redis(host="127.0.0.1", port=free_port())  # the store's client: retries with backoff
    priors = P.PoolPriors(down, "crossdraft:pool-priors:down")
    calls = []
    for name in ("hget", "hgetall", "pipeline"):  # count the attempts that reach the client
        real = getattr(priors._r, name)
        setattr(priors._r, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    request_of(priors, "latin/code", ["tiny", "family"], {"tiny": 1.3, "family": 2.2})
    seen, moves = request_of(priors, "latin/code", ["tiny", "family"], {"tiny": 1.3, "family": 2.2})
    assert set(seen) == {"family"} and moves == []
    assert set(priors.snapshot()) == {"latin/code"}
    assert calls == ["hget"]  # one refused call; the rest within PRIORS_RETRY_S did not try Redis again


def test_prompt_classes_tell_script_and_shape():
    code = "def merge(a: list[int], b: list[int]) -> list[int]:\n    out = []\n    while a and b:\n"
    assert P.text_class(code) == "latin/code"
    assert P.text_class("Write a short paragraph explaining why the sky is blue (in two sentences).") == "latin/prose"
    assert P.text_class("请用中文写一段话，介绍一下长城的历史。") == "cjk/prose"
    assert P.text_class("下面是一个函数：\ndef f(x):\n    return [x[i] for i in range(len(x))]  # 中文注释和代码") \
        .endswith("/code")
    assert P.text_class("Привет, как дела?") == "other/prose" and P.text_class("") == "other/prose"


class Tok:
    """A tokenizer that spells `known` characters one id each and any other character byte by byte."""

    def __init__(self, known: str):
        self.known = set(known)

    def __call__(self, text, add_special_tokens=False):
        n = sum(1 if ch in self.known else len(ch.encode()) for ch in text)
        return {"input_ids": list(range(n))}


def test_the_prior_puts_the_kinds_that_spell_the_prompt_first_in_the_operators_order():
    kinds = [P.DrafterKind(n, n, SimpleNamespace(drafter_tok=Tok(k))) for n, k in
             (("english", "abcdefghijklmnopqrstuvwxyz "), ("multi", "abcdefghijklmnopqrstuvwxyz 你好世界"))]
    assert P.prior_order(kinds, "hello world") == ["english", "multi"]
    assert P.prior_order(kinds, "你好世界你好") == ["multi", "english"]


def test_named_items_are_parsed_and_bad_ones_name_the_field():
    assert P.parse_named(["a=h:1,h:2", "b-2=h:3"], "drafter_pool") == {"a": "h:1,h:2", "b-2": "h:3"}
    assert P.parse_named("a=h:1; b=h:2", "drafter_pool") == {"a": "h:1", "b": "h:2"}
    for bad in (["Upper=h:1"], ["a=h:1", "a=h:2"], ["a="], ["noequals"]):
        with pytest.raises(InvalidArgument) as e:
            P.parse_named(bad, "drafter_pool")
        assert e.value.field == "drafter_pool"
    assert P.kind_name("Qwen/Qwen2.5-Coder-0.5B@main") == "qwen2-5-coder-0-5b-main"


def _config(argv, monkeypatch, env=None):
    from gateway.server import build_parser, config_from_args

    for k in ("CROSSDRAFT_DRAFTER_POOL", "CROSSDRAFT_DRAFTER_POOL_SERVICES", "CROSSDRAFT_DRAFTER_TOKENIZER",
              "CROSSDRAFT_DRAFTER_NAME"):
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    return config_from_args(build_parser().parse_args(["--verifier", "v:1", "--redis-url", "redis://r", *argv]))


def test_the_gateways_pool_flags_and_variables(monkeypatch):
    cfg = _config(["--drafter", "d:1", "--drafter-name", "first", "--drafter-pool", "b=h:2,h:3",
                   "--drafter-pool", "c=h:4", "--drafter-tokenizer", "/tok/first", "--drafter-tokenizer", "c=/tok/c"],
                  monkeypatch)
    assert cfg.drafter_pool == (("b", "h:2,h:3"), ("c", "h:4")) and cfg.drafter_name == "first"
    assert cfg.drafter_tokenizer == "/tok/first" and cfg.drafter_tokenizers == (("c", "/tok/c"),)
    cfg = _config(["--drafter", "d:1"], monkeypatch, {"CROSSDRAFT_DRAFTER_POOL": "b=h:2;c=h:3"})
    assert cfg.drafter_pool == (("b", "h:2"), ("c", "h:3"))
    cfg = _config(["--discovery", "kubernetes", "--verifier-service", "v", "--drafter-pool-service", "b=svc-b"],
                  monkeypatch)
    assert cfg.drafter_pool_services == (("b", "svc-b"),)


@pytest.mark.parametrize("argv, field", [
    (["--drafter-pool", "B=h:1"], "drafter_pool"),
    (["--drafter-pool", "b=nohostport"], "drafter_pool"),
    (["--drafter-pool", "b=h:1", "--drafter-pool", "b=h:2"], "drafter_pool"),
    (["--drafter-pool-service", "b=svc"], "drafter_pool_service"),  # (static discovery)
    (["--drafter-tokenizer", "zz=/tok"], "drafter_tokenizer"),  # not a kind
    (["--drafter-name", "b", "--drafter-pool", "b=h:1"], "drafter_name"),
])
def test_bad_pool_flags_name_the_field(monkeypatch, argv, field):
    with pytest.raises(InvalidArgument) as e:
        _config(["--drafter", "d:1", *argv], monkeypatch)
    assert e.value.field == field


def test_each_discovery_reads_its_own_pool_variable(monkeypatch):
    """The chart sets both variables (as it sets CROSSDRAFT_DRAFTER and CROSSDRAFT_DRAFTER_SERVICE)."""
    env = {"CROSSDRAFT_DRAFTER_POOL": "b=svc-b.ns.svc:50061", "CROSSDRAFT_DRAFTER_POOL_SERVICES": "b=svc-b"}
    static = _config(["--drafter", "d:1"], monkeypatch, env)
    assert static.drafter_pool == (("b", "svc-b.ns.svc:50061"),) and static.drafter_pool_services == ()
    k8s = _config(["--discovery", "kubernetes", "--verifier-service", "v"], monkeypatch, env)
    assert k8s.drafter_pool == () and k8s.drafter_pool_services == (("b", "svc-b"),)

