"""A pool of drafter kinds behind one gateway, and each request's choice among them.

A gateway may pair the target with several drafter models ("kinds": a same-family one, a tiny fast
one, a multilingual one...), each with its own replicas and its own vocabulary mapping
(:class:`DrafterKind`). No small model drafts well for every text, so each session chooses its kind
by measurement (:class:`PoolChoice`): it starts on the kind its history says is best -- or, new, on
the first kind whose tokenizer spells the prompt well (:func:`prior_order`: a drafter that spells
Chinese byte by byte cannot draft it) -- and after each round compares the kinds by what the one
chooser of draft lengths says each is worth: :meth:`crossdraft.decoding.policy.DraftPolicy.value`,
the best rate its blocks reach at the session's acceptance of that kind and the kind's own costs
(1.0 = drafting does not pay: "none"). A kind whose drafting fails or whose drafts do not pay is
left for one not yet measured (exploration); once each has been measured the best one is kept, and
left again only when another is worth clearly more (hysteresis). The estimates live with the
session in Redis (:meth:`PoolChoice.snapshot`), so later turns start from them; a request moves to
another kind between two rounds (:meth:`crossdraft.decoding.decode.Decoder.hand_over`), which never
changes the text: the target decides every token."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger("crossdraft.gateway.pool")
NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,39}\Z")

# How a request explores and keeps kinds. A kind is "measured" after EXPLORE_ROUNDS rounds that drafted
# with it (or once its policy stops drafting because its drafts do not pay); while the kind a request is on
# accepts less than GOOD_ALPHA of its drafts, or is not worth drafting at all, a kind not yet measured is
# tried. A request stays at least DWELL rounds on a kind it moved to, and moves to a measured kind only
# when that one is worth MARGIN times the current one's rate.
EXPLORE_ROUNDS = 2
GOOD_ALPHA = 0.6
DWELL = 3
MARGIN = 1.1
DECAY = 0.85  # acceptance counts forget like the policy's (crossdraft.decoding.acceptance.AcceptanceModel)
# the prior: a tokenizer spelling the prompt in at least this share of the best one's bytes per token is as fluent
# in its script as the best one
FLUENT = 0.85
# What similar requests found (PoolPriors): a new session starts from the estimates of the requests before it
# in its prompt's class, each counted as PRIOR_WEIGHT trials of the session's own (its rounds soon outweigh
# them); a request's measurement moves a class's estimate LEARN of the way; a kind no request of the class has
# measured in STALE requests is dropped from the class's estimates, so that it is explored again.
PRIOR_WEIGHT = 2.0
LEARN = 0.5
STALE = 8
# the shared estimates (Redis) expire a week after the last request taught them; a call to Redis for them waits
# at most PRIORS_WAIT_S, and after a failure the gateway uses its own memory for PRIORS_RETRY_S before trying again
PRIORS_TTL_S = 7 * 86400.0
PRIORS_WAIT_S = 0.25
PRIORS_RETRY_S = 10.0
CJK_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
CODE_CHARS = frozenset("{}[]()<>=;_#|\\")


def check_name(name: str, field: str = "drafter_pool") -> str:
    """A drafter kind's name: [a-z0-9][a-z0-9-]{0,39}."""
    from crossdraft.errors import InvalidArgument

    if not NAME_RE.match(name or ""):
        raise InvalidArgument(field, f"bad drafter kind name {name!r} (want [a-z0-9][a-z0-9-]{{0,39}})")
    return name


def kind_name(model: str) -> str:
    """A kind's name from its model's name: lower case, [a-z0-9-] only, at most 40 characters."""
    base = (model or "drafter").rstrip("/").split("/")[-1].lower()
    name = re.sub(r"[^a-z0-9-]+", "-", base).strip("-")[:40].strip("-")
    return name if NAME_RE.match(name) else "drafter"


def parse_named(specs, field: str) -> dict[str, str]:
    """NAME=VALUE items (a list of them, or one string of them separated by ';') as {NAME: VALUE}, in
    order; a NAME twice, a bad NAME or an empty VALUE is InvalidArgument naming `field`."""
    from crossdraft.errors import InvalidArgument

    if isinstance(specs, str):
        specs = [specs]
    items: dict[str, str] = {}
    for spec in specs or ():
        for part in (p.strip() for p in str(spec).split(";")):
            if not part:
                continue
            name, eq, value = part.partition("=")
            name, value = name.strip(), value.strip()
            if not eq or not value:
                raise InvalidArgument(field, f"want NAME=VALUE, got {part!r}")
            check_name(name, field)
            if name in items:
                raise InvalidArgument(field, f"drafter kind {name!r} given twice")
            items[name] = value
    return items


@dataclass
class DrafterKind:
    """One drafter model behind the gateway: its name, the placement pool of its replicas ("drafter" for
    the first kind, "drafter:NAME" for the others), its pairing with the target, its model and revision."""

    name: str
    key: str
    pair: object  # crossdraft.vocab.pair.TokenPair
    model: str = ""
    revision: str = ""


def quick_client(r):
    """A client of the same Redis as `r` (address, TLS, password) that fails fast: no retries, PRIORS_WAIT_S
    timeouts (None for None)."""
    if r is None:
        return None
    pool = r.connection_pool
    kw = dict(pool.connection_kwargs, socket_timeout=PRIORS_WAIT_S, socket_connect_timeout=PRIORS_WAIT_S,
              retry=Retry(NoBackoff(), 0))
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kw))


def kind_models(kinds) -> dict[str, str]:
    """{kind name: its model (at its revision)}: what the shared priors tell kinds of the same name apart by."""
    return {k.name: k.model + (f"@{k.revision}" if k.revision else "") for k in kinds}


def bytes_per_token(tok, text: str) -> float:
    """How many bytes of `text` one of the tokenizer's ids spells on average (a vocabulary that does not
    know the text's script spells it a byte or two at a time)."""
    data = text.encode("utf-8")
    if not data:
        return 0.0
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    return len(data) / max(1, n)


def prior_order(kinds: list[DrafterKind], text: str, sample_chars: int = 2000) -> list[str]:
    """The order in which a new session tries the kinds: first those whose tokenizers spell the prompt
    about as compactly as the best one (FLUENT of its bytes per token or more), in the gateway's order of kinds
    (the operator lists the cheapest first), then the others, most compact first. A prior only: the
    rounds' measurements decide."""
    if len(kinds) < 2 or not text:
        return [k.name for k in kinds]
    sample = text[-sample_chars:]
    bpt = {k.name: bytes_per_token(k.pair.drafter_tok, sample) for k in kinds}
    best = max(bpt.values())
    fluent = [k.name for k in kinds if bpt[k.name] >= FLUENT * best]
    rest = sorted((k.name for k in kinds if k.name not in fluent), key=lambda n: -bpt[n])
    return fluent + rest


def text_class(text: str, sample_chars: int = 2000) -> str:
    """A prompt's class for the pool's priors: its script ("cjk" where a fifth of its letters are Chinese,
    Japanese or Korean, else "latin" or "other") and its shape ("code" where brackets, operators, underscores
    and indented lines are frequent, else "prose"), e.g. "latin/code". A key for what similar requests
    measured, not a judgement: each request's own rounds decide."""
    sample = text[-sample_chars:]
    letters = [c for c in sample if c.isalpha()]
    if not letters:
        script = "other"
    elif len(CJK_RE.findall(sample)) >= 0.2 * len(letters):
        script = "cjk"
    else:
        script = "latin" if sum(c.isascii() for c in letters) >= 0.8 * len(letters) else "other"
    visible = sum(not c.isspace() for c in sample)
    lines = sample.split("\n")
    marks = sum(c in CODE_CHARS for c in sample) + 4 * sum(ln.startswith(("  ", "\t")) and ln.strip() != ""
                                                          for ln in lines)
    shape = "code" if marks >= max(3.0, 0.04 * visible) else "prose"
    return f"{script}/{shape}"


class PoolPriors:
    """The gateways' memory of what each drafter kind was worth for each class of prompt (text_class), learned
    from the requests' own measurements: a new session starts on the kind that served its class best and
    explores only kinds its class has not measured lately, instead of measuring every kind again from scratch.

    With a Redis client (the session store's) every gateway replica of one target reads and teaches the same
    estimates: one hash, ``key``, a JSON document per class, each update a WATCH/MULTI transaction (several
    replicas learning at once never lose one another's update). Each entry names the kind's model, so a
    gateway whose kind of the same name serves another model ignores it. Redis trouble never fails a request:
    the gateway then uses and teaches its own memory until Redis answers again. Thread-safe."""

    def __init__(self, redis=None, key: str = "", ttl_s: float = PRIORS_TTL_S) -> None:
        self._lock = threading.Lock()
        self._cls: dict[str, dict[str, dict]] = {}  # this gateway's memory: class -> kind -> {"v", "a", "age", "model"}
        self._r, self._key, self._ttl_ms = quick_client(redis), key, int(ttl_s * 1000)
        self._skip_until = 0.0  # after a failure Redis is left alone for PRIORS_RETRY_S

    def _shared(self, fn) -> tuple[bool, object]:
        """(True, fn()) on the shared estimates; (False, None) without Redis, when it did not answer, or while
        it is left alone after a failure (logged once per outage): a request never waits on it for long."""
        if self._r is None or time.monotonic() < self._skip_until:
            return False, None
        try:
            out = fn()
        except redis.RedisError as e:
            if not self._skip_until:
                log.warning("pool priors: Redis unavailable (%s: %s); using this gateway's own until it answers",
                            type(e).__name__, e)
            self._skip_until = time.monotonic() + PRIORS_RETRY_S
            return False, None
        self._skip_until = 0.0
        return True, out

    def _read(self, cls: str) -> dict:
        ok, doc = self._shared(lambda: self._r.hget(self._key, cls))
        if ok:
            return _doc(doc)
        with self._lock:
            return {n: dict(p) for n, p in self._cls.get(cls, {}).items()}

    def seed(self, cls: str, models: dict | None = None) -> dict:
        """Estimates in PoolChoice's form for a new session of class `cls` ({} when nothing is known); with
        `models` ({kind: model}), only entries learned for the same model of each kind."""
        known = self._read(cls)
        return {n: {"s": p["a"] * PRIOR_WEIGHT, "t": PRIOR_WEIGHT, "n": EXPLORE_ROUNDS, "v": p["v"]}
                for n, p in known.items() if not models or not p.get("model") or models.get(n) == p["model"]}

    def age(self, cls: str) -> None:
        """A request of class `cls` ran target-only because its class's estimates said no kind pays
        (PoolChoice.none_pays): every kind of the class ages, so that after STALE such requests the
        estimates expire and a request of the class measures the kinds again."""
        self._blend(cls, {}, {})

    def learn(self, cls: str, measured: dict, models: dict | None = None) -> None:
        """A request of class `cls` finished with `measured` ({kind: estimate}, only the kinds its own rounds
        measured; `models`: {kind: model}): move the class's estimates toward them; kinds it did not measure
        age."""
        if measured:
            self._blend(cls, measured, models or {})

    def _blend(self, cls: str, measured: dict, models: dict) -> None:
        """This gateway's copy and the shared estimates of class `cls` after a request (blend_priors)."""
        with self._lock:
            self._cls[cls] = blend_priors(self._cls.get(cls, {}), measured, models)
        self._shared(lambda: self._learn_shared(cls, measured, models))

    def _learn_shared(self, cls: str, measured: dict, models: dict) -> None:
        with self._r.pipeline() as pipe:
            for _ in range(8):  # another replica's update between the read and the write: read again
                try:
                    pipe.watch(self._key)
                    doc = _doc(pipe.hget(self._key, cls))
                    pipe.multi()
                    pipe.hset(self._key, cls, json.dumps(blend_priors(doc, measured, models)))
                    pipe.pexpire(self._key, self._ttl_ms)
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue
            log.warning("pool priors: class %s not updated (8 concurrent updates in a row)", cls)

    def snapshot(self) -> dict:
        """Every class's estimates as this gateway sees them (the shared ones where Redis answers)."""
        ok, shared = self._shared(lambda: self._r.hgetall(self._key))
        if ok:
            return {k.decode() if isinstance(k, bytes) else k: _doc(v) for k, v in shared.items()}
        with self._lock:
            return {c: {n: dict(p) for n, p in kinds.items()} for c, kinds in self._cls.items()}


def _doc(raw) -> dict:
    """A class's shared estimates from their JSON ({} for none, or for a document that is not theirs)."""
    try:
        doc = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    ok = isinstance(doc, dict) and all(isinstance(p, dict) and {"v", "a"} <= set(p) for p in doc.values())
    return doc if ok else {}


def blend_priors(kinds: dict, measured: dict, models: dict) -> dict:
    """A class's estimates ({kind: {"v", "a", "age", "model"}}) after one more request measured `measured`:
    each measured kind moves LEARN of the way to the request's value and acceptance (a kind new to the class,
    or learned for another model, takes them as they are); the others age, and go at STALE."""
    out = {}
    for name, p in kinds.items():
        if name not in measured:
            if p.get("age", 0) + 1 < STALE:
                out[name] = {**p, "age": p.get("age", 0) + 1}
    for name, e in measured.items():
        a = e["s"] / e["t"] if e.get("t", 0) > 0 else 0.0
        model = models.get(name, "")
        p = kinds.get(name)
        if p is None or (model and p.get("model") and p["model"] != model):
            out[name] = {"v": float(e["v"]), "a": a, "age": 0, "model": model}
        else:
            out[name] = {"v": p["v"] + LEARN * (float(e["v"]) - p["v"]), "a": p["a"] + LEARN * (a - p["a"]),
                         "age": 0, "model": model or p.get("model", "")}
    return out


class PoolChoice:
    """One request's choice of drafter kind. ``estimates``: {kind: {"s": accepted, "t": trials (decayed
    counts, as the policy's acceptance model), "n": rounds that drafted, "v": the kind's value the last
    time it was measured}} carried over from the session's earlier turns. ``switch(name)`` returns the
    Decoder of kind `name` for this request (None: no ready replica of it)."""

    def __init__(self, order: list[str], estimates: dict | None, switch, metrics=None, prior: dict | None = None):
        self.order = list(order)
        # the session's own estimates; a new session's come from similar requests (PoolPriors.seed)
        self.est = {name: dict(e) for name, e in (estimates or prior or {}).items() if name in self.order}
        self.prior = not estimates and bool(self.est)
        self.here: dict[str, int] = {}  # rounds that measured each kind in this request
        # each kind's acceptance counts over this request's drafted rounds (not decayed: what the request found
        # of the text, not only its last rounds) and the policy that priced them: what the class learns
        self.whole: dict[str, list[float]] = {}
        self.policies: dict[str, object] = {}
        self.switch = switch
        self.metrics = metrics
        self.current: str | None = None
        self.down: set[str] = set()  # kinds whose drafter failed this request (or had no ready replica)
        self.since = 0  # rounds on the current kind
        self.reason = ""  # why the current kind was chosen: start, explore, exploit, failover, none


    # ---- the first choice ----------------------------------------------------------------------
    def measured(self, name: str) -> bool:
        return self.est.get(name, {}).get("n", 0) >= EXPLORE_ROUNDS

    def value(self, name: str) -> float:
        return float(self.est.get(name, {}).get("v", 1.0))

    def alpha(self, name: str) -> float:
        e = self.est.get(name)
        return e["s"] / e["t"] if e and e.get("t", 0) > 0 else 0.0

    def live(self) -> list[str]:
        """The kinds this request may still use (its drafter did not fail, it had a ready replica)."""
        return [n for n in self.order if n not in self.down]

    def candidates(self) -> list[str]:
        """The kinds this request may still use, best first: measured ones by value, then the prior order."""
        live = self.live()
        known = sorted((n for n in live if self.measured(n)), key=lambda n: -self.value(n))
        return [n for n in known if self.value(n) > 1.0] + [n for n in live if not self.measured(n)] + \
            [n for n in known if self.value(n) <= 1.0]

    def none_pays(self) -> bool:
        """A new session whose class's estimates (PoolPriors) measured every kind it may use, none of them
        worth drafting: it runs target-only, not paying for a drafter's session, probes and a policy's
        rounds on the way to the same answer (similar requests measure the kinds again once the class's
        estimates expire: PoolPriors.age)."""
        live = self.live()
        return self.prior and bool(live) and all(self.measured(n) and self.value(n) <= 1.0 for n in live)

    def first(self) -> list[str]:
        """The kinds to start on, in order (the caller takes the first with a ready replica)."""
        return self.candidates()

    def started(self, name: str | None, reason: str = "start") -> None:
        self.current, self.since, self.reason = name, 0, reason
        if name is not None and self.metrics is not None:
            self.metrics.pool_choice(name, reason)

    # ---- after each round ----------------------------------------------------------------------
    def __call__(self, req, ev):
        """Decoder.run's chooser: the Decoder of the kind to move to, or None to stay."""
        cur = self.current
        if cur is None:
            return None
        if not req.stats.drafter_choice:  # (how the request came to its first kind: start or prior)
            req.stats.drafter_choice = self.reason
        self.since += 1
        e = self.est.setdefault(cur, {"s": 0.0, "t": 0.0, "n": 0, "v": 1.0})
        if ev.drafted > 0 or (req.spec and ev.skip_reason == "acceptance"):  # (what the class may learn from:
            self.here[cur] = self.here.get(cur, 0) + 1  # a drafter busy now is the moment's, not the text's)
        if ev.drafted > 0:
            trials = ev.accepted + (1 if ev.accepted < ev.drafted else 0)  # (the block ended in a rejection)
            e["s"] = DECAY * e["s"] + ev.accepted
            e["t"] = DECAY * e["t"] + trials
            e["n"] += 1
            w = self.whole.setdefault(cur, [0.0, 0.0])
            w[0] += ev.accepted
            w[1] += trials
            if req.policy is not None:
                e["v"] = req.policy.value()
                self.policies[cur] = req.policy
        elif req.spec and ev.skip_reason in ("acceptance", "drafter busy"):
            # the kind's policy stopped drafting for reasons of its own: measured, and worth nothing now
            e["n"], e["v"] = max(e["n"], EXPLORE_ROUNDS), 1.0
        if not req.spec:  # its drafter failed (or refused the request): another kind, else target-only
            if not req.stats.drafter_fallback or req.d is None:
                return None
            self.down.add(cur)
            return self._move(req, "failover", [n for n in self.candidates() if n != cur])
        if self.since < DWELL or not self.measured(cur):
            return None
        live = self.live()
        untried = [n for n in live if n != cur and not self.measured(n)]
        poor = self.alpha(cur) < GOOD_ALPHA or self.value(cur) <= 1.0
        if untried and poor:
            return self._move(req, "explore", untried)
        best = max((n for n in live if self.measured(n)), key=self.value, default=cur)
        if best != cur and self.value(best) > MARGIN * self.value(cur):
            return self._move(req, "exploit", [best])
        adaptive = getattr(getattr(req, "draft", None), "adaptive", True)  # (a fixed block drafts whatever)
        if not untried and self.value(cur) <= 1.0 and adaptive and self.reason != "none":
            self.reason = "none"  # no kind pays: the request stays here, its policy drafting only in rare probes
            req.stats.drafter_choice = "none"
            if self.metrics is not None:
                self.metrics.pool_choice(cur, "none")
        return None

    def _move(self, req, reason: str, names: list[str]):
        for name in names:
            dec = self.switch(name)
            if dec is None:
                self.down.add(name)
                continue
            if reason == "failover":  # the request drafts again: it did not fall back to target-only
                req.stats.drafter_fallback = False
            self.started(name, reason)
            req.stats.drafter_choice = reason
            return dec
        return None

    def learned(self) -> dict:
        """The estimates of the kinds this request's own rounds measured (what PoolPriors learns from). A kind's
        value is priced at its acceptance over the whole request where it drafted (alone, the drafter at its
        usual speed: DraftPolicy.value): a request that drafted well and whose last rounds stopped on a hard
        stretch still says the kind pays for its class, and one whose lone probe came true at the end does
        not say a hopeless kind does."""
        out = {}
        for n, r in self.here.items():
            if r < EXPLORE_ROUNDS or n not in self.est:
                continue
            e = dict(self.est[n])
            w, policy = self.whole.get(n), self.policies.get(n)
            if w and w[1] > 0 and policy is not None:
                e["v"] = policy.value(w[0] / w[1], usual_speed=True)
            out[n] = e
        return out

    def snapshot(self) -> dict:
        """The estimates to keep with the session (rounded: a session document stays small)."""
        return {n: {"s": round(e["s"], 3), "t": round(e["t"], 3), "n": int(e["n"]), "v": round(e["v"], 4)}
                for n, e in self.est.items()}


def pool_args(a, env) -> tuple[tuple, tuple, str | None, tuple]:
    """The gateway's pool flags (gateway.server): (pool, pool services, the first kind's tokenizer, the pool
    kinds' tokenizers), each from its flag, else its CROSSDRAFT_* variable (``env(NAME, default)``); NAME=VALUE
    items checked (:func:`parse_named`)."""
    from crossdraft.errors import InvalidArgument

    pool = parse_named(a.drafter_pool if a.drafter_pool else env("DRAFTER_POOL", ""), "drafter_pool")
    services = parse_named(a.drafter_pool_service if a.drafter_pool_service
                           else env("DRAFTER_POOL_SERVICES", ""), "drafter_pool_service")
    first, named = None, []
    for spec in a.drafter_tokenizer or ([env("DRAFTER_TOKENIZER", "")] if env("DRAFTER_TOKENIZER", "") else []):
        name, eq, path = spec.partition("=")
        if eq and NAME_RE.match(name):
            named.append(f"{name}={path}")
        elif first is None:
            first = spec
        else:
            raise InvalidArgument("drafter_tokenizer",
                                  "given twice for the first drafter (name a pool kind: NAME=PATH)")
    tokenizers = parse_named(named, "drafter_tokenizer")
    kinds = set(pool) | set(services)
    for name in tokenizers:
        if name not in kinds:
            raise InvalidArgument("drafter_tokenizer", f"{name!r} is not a drafter kind of --drafter-pool")
    return tuple(pool.items()), tuple(services.items()), first, tuple(tokenizers.items())


def drafter_keys(placement) -> list[str]:
    """The placement keys of the gateway's drafter kinds, in the operator's order ("drafter" first)."""
    return [k for k in placement.pools if k.startswith("drafter") and placement.pools[k] is not None]


def build_kinds(cfg, placement, t_tok, vinfo: dict, more: dict, *, healthy, **kw) -> tuple[list, list]:
    """The gateway's drafter kinds at its start, in order (the first drafter, then the pool's), and the
    placement keys of those not up yet: ``healthy(key)`` gives a client of the kind's first replica that
    answers its health check, or None when none does in time (the gateway pairs that kind later, as soon as
    one answers: :meth:`gateway.core.Gateway.pair_later`). ``kw``: as :func:`pair_kind`'s."""
    kinds, pending = [], []
    for key in drafter_keys(placement):
        drafter = healthy(key)
        if drafter is None:
            pending.append(key)
        else:
            kinds.append(pair_kind(cfg, key, drafter, t_tok, vinfo, more, **kw))
    return kinds, pending


def pair_kind(cfg, key: str, drafter, t_tok, vinfo: dict, more: dict, *, tokenizer, check, make_pair) -> DrafterKind:
    """The drafter kind of placement key `key`, from the ModelInfo and tokenizer of its replica `drafter`
    (``tokenizer(path or None, client)``; checked against the server's digest by ``check``), paired with the
    target's (``make_pair``): its vocabulary mapping is built from its tokenizer."""
    from crossdraft.errors import InvalidArgument

    dinfo = drafter.info()
    name = key.partition(":")[2] or cfg.drafter_name or kind_name(dinfo.get("model_name", ""))
    if key == "drafter" and name in more:
        raise InvalidArgument("drafter_pool", f"{name!r} names the first drafter (--drafter, serving "
                                              f"{dinfo.get('model_name')}): give the pool kind another name")
    d_tok = tokenizer(cfg.drafter_tokenizer if key == "drafter" else dict(cfg.drafter_tokenizers).get(name), drafter)
    check(d_tok, dinfo, "drafter")
    pair = make_pair(t_tok, d_tok, vinfo["vocab_size"], dinfo["vocab_size"], draft_vocab=cfg.draft_vocab)
    return DrafterKind(name, key, pair, dinfo.get("model_name", ""), dinfo.get("revision") or "")
