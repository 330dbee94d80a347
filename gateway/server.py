"""Wiring of the gateway: config -> clients, tokenizers, mapping, Redis -> gRPC + REST servers."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

from crossdraft.argtypes import float_arg, int_arg, port_arg
from crossdraft.decoding.pipeline import PIPELINE_CHOICES
from crossdraft.decoding.policy import DEFAULT_DRAFT_VOCAB
from crossdraft.errors import CrossdraftError, InvalidArgument, Unavailable
from crossdraft.serving.tls import TLSConfig

from .config import GatewayConfig
from .discovery import static_pool
from .pool import pool_args

SERVICE_NAME = "crossdraft.v1.GatewayService"
log = logging.getLogger("crossdraft.gateway")


def _env(name, default):
    return os.environ.get(f"CROSSDRAFT_{name}", default)


def build_parser() -> argparse.ArgumentParser:
    """The gateway's flags; most default to a CROSSDRAFT_* environment variable."""
    p = argparse.ArgumentParser(prog="python -m gateway", description="crossdraft gateway: REST + gRPC front door")
    _add_address_flags(p)
    _add_request_flags(p)
    _add_limit_flags(p)
    _add_security_flags(p)
    return p


def _add_address_flags(p: argparse.ArgumentParser) -> None:
    """Where the model servers and Redis are, and where the gateway listens."""
    p.add_argument("--verifier", default=_env("VERIFIER", None),
                   help="verifier address host:port (env CROSSDRAFT_VERIFIER)")
    p.add_argument("--drafter", default=_env("DRAFTER", None),
                   help="drafter address host:port (env CROSSDRAFT_DRAFTER; unset = target-only)")
    p.add_argument("--drafter-name", default=_env("DRAFTER_NAME", None), metavar="NAME",
                   help="the name of the first drafter kind (--drafter) in stats, spans and metrics (default: its "
                        "model's name) (env CROSSDRAFT_DRAFTER_NAME)")
    p.add_argument("--drafter-pool", action="append", default=None, metavar="NAME=HOST:PORT[,HOST:PORT]",
                   help="one more drafter kind (model) behind the gateway, by name, with its replicas; repeatable: "
                        "each session drafts with the kind that measures best for it, or none (env "
                        "CROSSDRAFT_DRAFTER_POOL: NAME=...;NAME=...)")
    p.add_argument("--discovery", choices=["static", "kubernetes"], default=_env("DISCOVERY", "static"),
                   help="static: --verifier/--drafter address lists; kubernetes: watch the Services' EndpointSlices")
    p.add_argument("--verifier-service", default=_env("VERIFIER_SERVICE", None),
                   help="kubernetes: verifier headless Service")
    p.add_argument("--drafter-service", default=_env("DRAFTER_SERVICE", None),
                   help="kubernetes: drafter headless Service")
    p.add_argument("--drafter-pool-service", action="append", default=None, metavar="NAME=SERVICE",
                   help="kubernetes: the headless Service of one more drafter kind; repeatable (env "
                        "CROSSDRAFT_DRAFTER_POOL_SERVICES: NAME=SERVICE;NAME=SERVICE)")
    p.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "default"),
                   help="kubernetes: namespace (env POD_NAMESPACE)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"), help="Redis URL for sessions (env REDIS_URL)")
    p.add_argument("--host", default=_env("HOST", "0.0.0.0"))
    p.add_argument("--http-port", type=port_arg("--http-port", env="CROSSDRAFT_HTTP_PORT", zero="a free port"),
                   default=str(_env("HTTP_PORT", 8000)))
    p.add_argument("--grpc-port", type=port_arg("--grpc-port", env="CROSSDRAFT_GRPC_PORT", zero="a free port"),
                   default=str(_env("GRPC_PORT", 50051)))


def _add_request_flags(p: argparse.ArgumentParser) -> None:
    """Tokenizers, sessions and drafting: how the gateway runs a request."""
    p.add_argument("--target-tokenizer", default=_env("TARGET_TOKENIZER", None), help="default: the verifier's model")
    p.add_argument("--drafter-tokenizer", action="append", default=None, metavar="[NAME=]PATH",
                   help="the drafter's tokenizer (default: fetched from the drafter); NAME=PATH: a pool kind's; "
                        "repeatable (env CROSSDRAFT_DRAFTER_TOKENIZER)")
    p.add_argument("--session-ttl-s", type=float_arg("--session-ttl-s", 0, above=True, env="CROSSDRAFT_SESSION_TTL_S"),
                   default=str(_env("SESSION_TTL_S", 3600)))
    p.add_argument("--drafter-timeout-s",
                   type=float_arg("--drafter-timeout-s", 0, above=True, env="CROSSDRAFT_DRAFTER_TIMEOUT_S"),
                   default=str(_env("DRAFTER_TIMEOUT_S", 10)))
    p.add_argument("--round-log", default=_env("ROUND_LOG", "") or None,
                   help="append one JSON line per round to this file: blocks drafted and accepted, times, and the "
                        "cost model's view (load, acceptance, scales) -- for tracing its decisions")
    p.add_argument("--colocated", choices=("auto", "yes", "no"), default=_env("COLOCATED", "auto"),
                   help="whether the drafters compute on their verifiers' hardware (their steps then stall the "
                        "verification of every session; the draft-length policy prices drafting under load by it): "
                        "auto = both addresses on the loopback or the same host")
    p.add_argument("--pipeline", choices=PIPELINE_CHOICES, default=_env("PIPELINE", "auto"),
                   help="pipelined rounds: draft each block's successor while the block is verified (drafting off "
                        "the critical path); auto = on where the drafter does not share the verifier's hardware "
                        "(not --colocated) (env CROSSDRAFT_PIPELINE)")
    p.add_argument("--branch", choices=("on", "off"), default=_env("BRANCH", "off"),
                   help="pipelined greedy rounds of one vocabulary: beside each block's successor, also draft the "
                        "block after the likeliest correction of this one (the drafter's second choice where it "
                        "most likely misses), used when the verification makes that correction (env CROSSDRAFT_BRANCH)")
    p.add_argument("--load-gate", choices=("on", "off"), default=_env("LOAD_GATE", "off"),
                   help="experimental: under load, hold drafting where target-only rounds measure more goodput at "
                        "that load (per verifier and load level, re-tried now and then; docs/design.md); off (the "
                        "default) = the draft-length policy's model alone decides (env CROSSDRAFT_LOAD_GATE)")
    p.add_argument("--draft-vocab", type=int_arg("--draft-vocab", 0, env="CROSSDRAFT_DRAFT_VOCAB"),
                   default=str(_env("DRAFT_VOCAB", DEFAULT_DRAFT_VOCAB)),
                   help="the drafter drafts from its this many most frequent tokens only (by its tokenizer's merge "
                        "order; its LM head is pruned to them, so its steps read fewer weights; the output is "
                        "unchanged: the target verifies every token); 0 = every token (env CROSSDRAFT_DRAFT_VOCAB)")
    p.add_argument("--connect-timeout-s",
                   type=float_arg("--connect-timeout-s", 0, above=True, env="CROSSDRAFT_CONNECT_TIMEOUT_S"),
                   default=str(_env("CONNECT_TIMEOUT_S", 900)),
                   help="how long to wait at start for a verifier to become healthy (then the gateway exits)")
    p.add_argument("--drafter-start-wait-s",
                   type=float_arg("--drafter-start-wait-s", 0, env="CROSSDRAFT_DRAFTER_START_WAIT_S"),
                   default=str(_env("DRAFTER_START_WAIT_S", 60)),
                   help="then how long to wait for each drafter kind; a kind not up by then is paired in the "
                        "background once one of its replicas answers, and requests meanwhile draft with the other "
                        "kinds or run target-only (env CROSSDRAFT_DRAFTER_START_WAIT_S)")


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Limits of a request and of the gateway: token budgets, admission, drain, stale pairing."""
    p.add_argument("--max-new-tokens-limit",
                   type=int_arg("--max-new-tokens-limit", 1, env="CROSSDRAFT_MAX_NEW_TOKENS_LIMIT"),
                   default=str(_env("MAX_NEW_TOKENS_LIMIT", 4096)))
    p.add_argument("--default-max-new-tokens",
                   type=int_arg("--default-max-new-tokens", 1, env="CROSSDRAFT_DEFAULT_MAX_NEW_TOKENS"),
                   default=str(_env("DEFAULT_MAX_NEW_TOKENS", 64)),
                   help="max_new_tokens when a request gives none")
    p.add_argument("--default-temperature",
                   type=float_arg("--default-temperature", 0, env="CROSSDRAFT_DEFAULT_TEMPERATURE"),
                   default=str(_env("DEFAULT_TEMPERATURE", 0.0)),
                   help="temperature when a request gives none (0 = greedy)")
    p.add_argument("--drain-timeout-s",
                   type=float_arg("--drain-timeout-s", 0, env="CROSSDRAFT_DRAIN_TIMEOUT_S"),
                   default=str(_env("DRAIN_TIMEOUT_S", 30)),
                   help="on SIGTERM: /readyz turns 503 and new requests get 503 at once; in-flight ones get "
                        "this long to finish before the gateway exits")
    p.add_argument("--stale-pairing-restart-s",
                   type=float_arg("--stale-pairing-restart-s", 0, env="CROSSDRAFT_STALE_PAIRING_RESTART_S"),
                   default=str(_env("STALE_PAIRING_RESTART_S", 60)),
                   help="every verifier serving the paired model at another revision this long (a rollout "
                        "finished after this gateway paired the old one): /healthz turns 503 so that the "
                        "orchestrator restarts the gateway, which pairs the new revision; 0 = never")
    p.add_argument("--max-concurrent-requests",
                   type=int_arg("--max-concurrent-requests", 1, env="CROSSDRAFT_MAX_CONCURRENT_REQUESTS"),
                   default=str(_env("MAX_CONCURRENT_REQUESTS", 256)),
                   help="generations running at once (more wait in the queue)")
    p.add_argument("--max-queued-requests",
                   type=int_arg("--max-queued-requests", 0, env="CROSSDRAFT_MAX_QUEUED_REQUESTS"),
                   default=str(_env("MAX_QUEUED_REQUESTS", 256)),
                   help="generations waiting for a slot; past this, HTTP 429 / RESOURCE_EXHAUSTED at once")
    p.add_argument("--queue-timeout-s",
                   type=float_arg("--queue-timeout-s", 0, env="CROSSDRAFT_QUEUE_TIMEOUT_S"),
                   default=str(_env("QUEUE_TIMEOUT_S", 30)),
                   help="a queued generation without a slot after this long gets 429 / RESOURCE_EXHAUSTED")


def _add_security_flags(p: argparse.ArgumentParser) -> None:
    """TLS on the public side and to the model servers, and Redis credentials."""
    p.add_argument("--tls-cert-file", default=_env("TLS_CERT_FILE", ""),
                   help="serve REST (HTTPS) and gRPC over TLS with this certificate (PEM; re-read when it "
                        "changes) (env CROSSDRAFT_TLS_CERT_FILE)")
    p.add_argument("--tls-key-file", default=_env("TLS_KEY_FILE", ""),
                   help="the certificate's private key (env CROSSDRAFT_TLS_KEY_FILE)")
    p.add_argument("--upstream-tls-ca-file", default=_env("UPSTREAM_TLS_CA_FILE", ""),
                   help="talk TLS to the drafter/verifier servers, verifying them with this CA "
                        "(env CROSSDRAFT_UPSTREAM_TLS_CA_FILE)")
    p.add_argument("--upstream-tls-cert-file", default=_env("UPSTREAM_TLS_CERT_FILE", ""),
                   help="the gateway's client certificate for mutual TLS with the model servers "
                        "(env CROSSDRAFT_UPSTREAM_TLS_CERT_FILE)")
    p.add_argument("--upstream-tls-key-file", default=_env("UPSTREAM_TLS_KEY_FILE", ""),
                   help="its private key (env CROSSDRAFT_UPSTREAM_TLS_KEY_FILE)")
    p.add_argument("--upstream-tls-server-name", default=_env("UPSTREAM_TLS_SERVER_NAME", ""),
                   help="the name the model servers' certificates carry, when they are dialled by IP "
                        "(env CROSSDRAFT_UPSTREAM_TLS_SERVER_NAME)")
    p.add_argument("--redis-password-file", default=_env("REDIS_PASSWORD_FILE", ""),
                   help="a file holding the Redis password (else env REDIS_PASSWORD, else none)")
    p.add_argument("--redis-tls-ca-file", default=_env("REDIS_TLS_CA_FILE", ""),
                   help="CA of the Redis server's certificate for rediss:// URLs (default: system roots) "
                        "(env CROSSDRAFT_REDIS_TLS_CA_FILE)")


def _redis_password(a) -> str:
    path = getattr(a, "redis_password_file", "") or ""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as e:
            raise InvalidArgument("redis_password_file", f"cannot read {path}: {e.strerror or e}") from None
    return os.environ.get("REDIS_PASSWORD", "")


def config_from_args(a) -> GatewayConfig:
    if a.discovery == "static" and not a.verifier:
        raise InvalidArgument("verifier", "is required (--verifier or CROSSDRAFT_VERIFIER)")
    if a.discovery == "kubernetes" and not a.verifier_service:
        raise InvalidArgument("verifier_service", "is required with --discovery kubernetes")
    if not a.redis_url:
        raise InvalidArgument("redis_url", "is required (--redis-url or REDIS_URL)")
    # each number's own range is checked where argparse reads it (crossdraft.argtypes); what is left
    # here relates two flags
    if not a.default_max_new_tokens <= a.max_new_tokens_limit:
        raise InvalidArgument("default_max_new_tokens", f"must be in [1, {a.max_new_tokens_limit}]")
    if a.colocated not in ("auto", "yes", "no"):  # argparse checks choices on the command line, not on env defaults
        raise InvalidArgument("colocated", f"must be one of auto, yes, no; got {a.colocated!r}")
    if a.load_gate not in ("on", "off"):
        raise InvalidArgument("load_gate", f"must be one of on, off; got {a.load_gate!r}")
    if a.branch not in ("on", "off"):
        raise InvalidArgument("branch", f"must be one of on, off; got {a.branch!r}")
    if a.pipeline not in PIPELINE_CHOICES:
        raise InvalidArgument("pipeline", f"must be one of {', '.join(PIPELINE_CHOICES)}; got {a.pipeline!r}")
    pool, pool_services, d_tok, pool_toks = pool_args(a, _env)
    # the flag of the other discovery is a mistake; its variable is not (a chart sets both, as it sets
    # CROSSDRAFT_DRAFTER and CROSSDRAFT_DRAFTER_SERVICE): the discovery in use reads its own
    if a.discovery == "kubernetes" and not a.drafter_pool:
        pool = ()
    if a.discovery == "static" and not a.drafter_pool_service:
        pool_services = ()
    d_name = getattr(a, "drafter_name", None) or None
    if d_name:
        from .pool import check_name

        check_name(d_name, "drafter_name")
        if d_name in dict(pool) or d_name in dict(pool_services):
            raise InvalidArgument("drafter_name", f"{d_name!r} also names a --drafter-pool kind")
    if pool and a.discovery != "static":
        raise InvalidArgument("drafter_pool",
                              "takes addresses with --discovery static (kubernetes: --drafter-pool-service)")
    if pool_services and a.discovery != "kubernetes":
        raise InvalidArgument("drafter_pool_service", "needs --discovery kubernetes (static: --drafter-pool)")
    for name, spec in pool:
        try:
            static_pool("drafter", spec)
        except ValueError as e:
            raise InvalidArgument("drafter_pool", f"{name}: {e}") from None
    tls = TLSConfig(cert_file=getattr(a, "tls_cert_file", "") or "", key_file=getattr(a, "tls_key_file", "") or "")
    tls.check_server(require_client_ca=False)
    upstream = TLSConfig(cert_file=getattr(a, "upstream_tls_cert_file", "") or "",
                         key_file=getattr(a, "upstream_tls_key_file", "") or "",
                         ca_file=getattr(a, "upstream_tls_ca_file", "") or "",
                         server_name=getattr(a, "upstream_tls_server_name", "") or "", prefix="upstream_tls")
    if upstream.cert_file and not upstream.ca_file:
        raise InvalidArgument("upstream_tls_ca_file", "is required with a client certificate (it turns TLS on)")
    upstream.check_client()
    if getattr(a, "redis_tls_ca_file", "") and not a.redis_url.startswith("rediss://"):
        raise InvalidArgument("redis_tls_ca_file", "needs a rediss:// Redis URL")
    return GatewayConfig(verifier=a.verifier, drafter=a.drafter or None, redis_url=a.redis_url, host=a.host,
                         discovery=a.discovery, verifier_service=a.verifier_service,
                         drafter_service=a.drafter_service or None, namespace=a.namespace,
                         http_port=a.http_port, grpc_port=a.grpc_port, target_tokenizer=a.target_tokenizer,
                         drafter_tokenizer=d_tok, drafter_name=d_name, drafter_pool=pool,
                         drafter_pool_services=pool_services,
                         drafter_tokenizers=pool_toks, session_ttl_s=a.session_ttl_s,
                         drafter_timeout_s=a.drafter_timeout_s, connect_timeout_s=a.connect_timeout_s,
                         drafter_start_wait_s=a.drafter_start_wait_s,
                         round_log=a.round_log, colocated=a.colocated, pipeline=a.pipeline, load_gate=a.load_gate,
                         branch=a.branch,
                         draft_vocab=a.draft_vocab,
                         max_new_tokens_limit=a.max_new_tokens_limit,
                         default_max_new_tokens=a.default_max_new_tokens, default_temperature=a.default_temperature,
                         max_concurrent_requests=a.max_concurrent_requests, max_queued_requests=a.max_queued_requests,
                         queue_timeout_s=a.queue_timeout_s, drain_timeout_s=a.drain_timeout_s,
                         stale_pairing_restart_s=a.stale_pairing_restart_s,
                         api_keys=frozenset(k.strip() for k in os.environ.get("CROSSDRAFT_API_KEYS", "").split(",")
                                            if k.strip()),
                         tls=tls, upstream_tls=upstream, redis_password=_redis_password(a),
                         redis_tls_ca_file=getattr(a, "redis_tls_ca_file", "") or "")


def build_gateway(cfg: GatewayConfig, tracer=None, pools=None):
    """Connect to the model servers, load tokenizers, build the mapping: a ready Gateway.

    pools: optional (verifier Pool, drafter Pool or None) kept current by the caller (tests feed
    them recorded EndpointSlices); default: from cfg (static lists or Kubernetes watches).
    """
    from crossdraft.models.tokenizers import load_tokenizer

    from .clients import RemoteDrafter, RemoteVerifier
    from .core import Gateway
    from .discovery import EndpointSliceWatcher, Placement, Pool, first_healthy
    from .pool import build_kinds, drafter_keys, pair_kind
    from .sessions import RedisSessionStore

    more: dict = {}  # a pool's kinds beyond the first: NAME -> Pool
    watchers: list = []  # kubernetes: the EndpointSlice watches that keep the pools current
    if pools is not None:
        vpool, dpool = pools[0], pools[1]
        more = dict(pools[2]) if len(pools) > 2 else {}
    elif cfg.discovery == "kubernetes":
        vpool = Pool("verifier")
        dpool = Pool("drafter") if cfg.drafter_service else None
        more = {name: Pool(f"drafter:{name}") for name, _ in cfg.drafter_pool_services}
        watched = [(vpool, cfg.verifier_service), (dpool, cfg.drafter_service)]
        watched += [(more[name], svc) for name, svc in cfg.drafter_pool_services]
        watchers = [EndpointSliceWatcher(pool, cfg.namespace, svc, cfg.port_name) for pool, svc in watched
                    if pool is not None]
        for w in watchers:
            w.start()
    else:
        try:
            vpool = static_pool("verifier", cfg.verifier)
            dpool = static_pool("drafter", cfg.drafter)
            more = {name: static_pool(f"drafter:{name}", spec) for name, spec in cfg.drafter_pool}
        except ValueError as e:
            raise InvalidArgument("verifier" if "verifier" in str(e) else "drafter", str(e)) from None
    up = cfg.upstream_tls if cfg.upstream_tls.enabled else None
    placement = Placement(vpool, dpool, lambda a: RemoteVerifier(a, tracer, timeout_s=cfg.verifier_timeout_s, tls=up),
                          lambda a: RemoteDrafter(a, tracer, timeout_s=cfg.drafter_timeout_s, tls=up), more)
    verifier = first_healthy(placement, "verifier", cfg.connect_timeout_s)
    vinfo = verifier.info()
    t_tok = (load_tokenizer(cfg.target_tokenizer, progress=False) if cfg.target_tokenizer
             else _remote_tokenizer(verifier))
    _check_digest(t_tok, vinfo, "target")
    deadline = time.time() + cfg.drafter_start_wait_s  # (each kind waits within what is left of it)
    pairing = dict(tokenizer=lambda path, client: load_tokenizer(path, progress=False) if path
                   else _remote_tokenizer(client), check=_check_digest, make_pair=token_pair)
    kinds, pending = build_kinds(cfg, placement, t_tok, vinfo, more, **pairing, healthy=lambda key: first_healthy(
        placement, key, max(0.0, deadline - time.time()), required=False))
    pair = kinds[0].pair if kinds else token_pair(t_tok, None, vinfo["vocab_size"], 0, draft_vocab=cfg.draft_vocab)
    store = RedisSessionStore(cfg.redis_url, ttl_s=cfg.session_ttl_s, password=cfg.redis_password,
                              tls_ca_file=cfg.redis_tls_ca_file)
    gw = Gateway(cfg, pair, placement, store, tracer=tracer, eos_ids=vinfo["eos_token_ids"],
                 max_context=vinfo["max_context_tokens"], kinds=kinds, kind_keys=drafter_keys(placement))

    def pair_one(key):  # a kind that was not up at start, once one of its replicas answers (else None)
        drafter = first_healthy(placement, key, 0.0, required=False)
        return None if drafter is None else pair_kind(cfg, key, drafter, t_tok, vinfo, more, **pairing)

    gw.pair_later(pending, pair_one)
    gw.watchers = watchers
    return gw


# The gateway's caches of tokenizations, bounded. Each Rust BPE tokenizer keeps every word it splits
# in a word cache (the tokenizers library's default: up to 10,000 words), and TokenPair keeps the
# round loop's re-encodings of short strings (16,384 by default, then it starts over). Text that
# keeps spelling new words -- every chat history, prompt and reply passes through both tokenizers --
# fills them for tens of minutes, and the gateway's memory with them. The word caches are off (0
# words: a 20,000-character prompt tokenizes as fast without it, 5.5 vs 5.7 ms with Qwen2.5's
# tokenizer), the memo holds up to MEMO_ENTRIES strings (the recurring ones are found there).
TOKENIZER_CACHE_WORDS = 0
MEMO_ENTRIES = 4096


def bound_caches(pair, words: int = TOKENIZER_CACHE_WORDS, memo: int = MEMO_ENTRIES) -> int:
    """Bound the word caches of the pair's BPE tokenizers to `words` entries each (0: off) and its
    memo to `memo` entries; returns how many tokenizers' caches were bounded (tokenizers without a
    word cache, or libraries without the call, keep theirs)."""
    pair.MEMO_SIZE = memo  # (this TokenPair only)
    bounded = 0
    for tok in (pair.target_tok, pair.drafter_tok):
        model = getattr(getattr(tok, "backend_tokenizer", None), "model", None)
        resize = getattr(model, "_resize_cache", None)
        if resize is None:
            continue
        try:
            resize(words)
        except Exception as e:  # noqa: BLE001 - a model without a word cache keeps working as it is
            log.info("tokenizer word cache not bounded: %s: %s", type(e).__name__, e)
            continue
        bounded += 1
    return bounded


def token_pair(t_tok, d_tok, target_vocab: int, drafter_vocab: int, **kw):
    """The gateway's TokenPair (crossdraft.vocab.pair), its caches bounded (:func:`bound_caches`)."""
    from crossdraft.vocab.pair import TokenPair

    pair = TokenPair(t_tok, d_tok, target_vocab, drafter_vocab, **kw)
    bound_caches(pair)
    return pair


def _remote_tokenizer(client):
    """The model server's own tokenizer, fetched over gRPC (cached on disk by its digest)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from crossdraft.home import crossdraft_home

    info = client.info()
    # keyed by the files, not only the vocabulary: the same vocabulary may come with another chat
    # template (a base and an instruct model) or special-token config
    digest = info.get("tokenizer_files_digest") or info["tokenizer_digest"] or "nodigest"
    d = Path(crossdraft_home()) / "tokenizers" / digest[:32]
    if not (d / ".complete").exists():
        files, _ = client.tokenizer_files()
        tmp = d.with_name(d.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            if "/" in name or name.startswith("."):
                raise CrossdraftError(f"{client.who} sent a bad tokenizer file name {name!r}")
            (tmp / name).write_bytes(content)
        (tmp / ".complete").write_text("ok")
        import shutil

        if d.exists() and not (d / ".complete").exists():
            shutil.rmtree(d, ignore_errors=True)  # left incomplete by a process that died writing it
        try:
            os.rename(tmp, d)
        except OSError:
            # another gateway on this $CROSSDRAFT_HOME renamed the same files there first (a directory
            # gets there complete, by rename, and may be loading now): keep it, drop ours. Replacing
            # it would remove it under that gateway's load, which would then fail to start.
            shutil.rmtree(tmp, ignore_errors=True)
            if not (d / ".complete").exists():
                raise
    return AutoTokenizer.from_pretrained(str(d))


def _check_digest(tok, info, who: str) -> None:
    from crossdraft.vocab.tokenbytes import tokenizer_digest

    if info["tokenizer_digest"] and tokenizer_digest(tok) != info["tokenizer_digest"]:
        raise CrossdraftError(f"the {who} tokenizer differs from the one the {who} server uses ({info['model_name']}); "
                              f"pass --{who}-tokenizer")

def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except CrossdraftError as e:
        print(f"gateway: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=os.environ.get("CROSSDRAFT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s gateway %(levelname)s %(message)s")
    from .memtrace import from_env as memtrace_from_env

    memtrace = memtrace_from_env()  # CROSSDRAFT_TRACEMALLOC=<file>: what grows (gateway/memtrace.py)
    if memtrace is not None:
        memtrace.install_signal()
    from crossdraft.serving import telemetry

    provider = telemetry.setup_tracing("crossdraft-gateway")
    tracer = telemetry.get_tracer(provider, "crossdraft.gateway")
    rc = _GatewayProcess(cfg, tracer, memtrace).run()
    try:
        provider.shutdown()
    except Exception:
        pass
    return rc


def _lazy_servicer(process: _GatewayProcess):
    """A GatewayService servicer that answers UNAVAILABLE until the gateway is built, then hands
    each call to the real servicer (its methods are looked up per call)."""
    from crossdraft.v1 import gateway_pb2_grpc

    class LazyServicer(gateway_pb2_grpc.GatewayServiceServicer):
        pass

    def late(name):
        def call(request, context):
            if process.servicer is None:
                raise Unavailable("the gateway is starting")
            return getattr(process.servicer, name)(request, context)

        return call

    lazy = LazyServicer()
    for name in ("Generate", "CreateSession", "GetSession", "DeleteSession"):
        setattr(lazy, name, late(name))
    return lazy


class _GatewayProcess:
    """One gateway process: the gRPC and REST servers open at once and answer UNAVAILABLE / 503
    while the gateway is built in the background (model servers, tokenizers, mapping); then they
    serve until a signal drains them (:meth:`drain`) or the build fails (exit status 1)."""

    def __init__(self, cfg: GatewayConfig, tracer, memtrace=None):
        self.cfg, self.tracer, self.memtrace = cfg, tracer, memtrace
        self.gw = None  # the Gateway, once built
        self.servicer = None  # its GatewayServicer, once built
        self.rc = 0
        self.tls_stop = threading.Event()

    def run(self) -> int:
        from crossdraft.serving import rpc
        from crossdraft.v1 import gateway_pb2_grpc

        cfg = self.cfg
        lazy = _lazy_servicer(self)
        # a Generate stream holds a handler thread for its whole run, and a queued one while it waits for
        # admission: threads for every generation the admission lets run or wait, plus a few for the short
        # calls (sessions, tokenizer), so that the admission limits -- not the pool -- decide who waits
        workers = cfg.max_concurrent_requests + cfg.max_queued_requests + 8
        server, self.grpc_port, self.health = rpc.build_server(
            [lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(lazy, s)], [SERVICE_NAME],
            cfg.host, cfg.grpc_port, max_workers=workers, tracer=self.tracer, tls=cfg.tls)
        server.start()
        self.http = self._http_server()
        print(f"crossdraft gateway: gRPC{' (TLS)' if cfg.tls.cert_file else ''} on {cfg.host}:{self.grpc_port}, "
              f"REST {self.scheme}://{cfg.host}:{cfg.http_port} (connecting...)", flush=True)
        threading.Thread(target=self._build, daemon=True).start()
        self.http.run()
        self.tls_stop.set()
        rpc.set_serving(self.health, ["", SERVICE_NAME], False)
        server.stop(5).wait()
        if self.memtrace is not None and self.memtrace.started:
            self.memtrace.stop()
        return self.rc

    @property
    def scheme(self) -> str:
        return "https" if self.cfg.tls.cert_file else "http"

    def _http_server(self):
        """uvicorn serving the REST app (with TLS, an SSLContext that follows certificate rotation);
        SIGTERM/SIGINT drain first (:meth:`drain`), a second signal, or one before the gateway is
        built, stops it at once."""
        import uvicorn

        from .rest import build_app

        cfg, process = self.cfg, self
        app = build_app(lambda: self.gw, self.tracer)
        tls_kw = dict(ssl_certfile=cfg.tls.cert_file, ssl_keyfile=cfg.tls.key_file) if cfg.tls.cert_file else {}
        ucfg = uvicorn.Config(app, host=cfg.host, port=cfg.http_port, log_level="warning", lifespan="off", **tls_kw)
        if cfg.tls.cert_file:
            from crossdraft.serving.tls import watch_ssl_context

            ucfg.load()  # builds the SSLContext now, so that a rotated certificate can be loaded into it
            watch_ssl_context(ucfg.ssl, cfg.tls, self.tls_stop)

        class DrainingServer(uvicorn.Server):
            draining = False

            def handle_exit(self, sig, frame):
                gw = process.gw
                if self.draining or gw is None:
                    return super().handle_exit(sig, frame)
                self.draining = True
                process.drain(gw)

        return DrainingServer(ucfg)

    def _build(self) -> None:
        """Build the gateway (in a thread: the servers answer meanwhile); on failure, stop with status 1."""
        from crossdraft.serving import rpc

        from .service import GatewayServicer

        cfg = self.cfg
        try:
            gw = build_gateway(cfg, self.tracer)
            self.gw = gw
            self.servicer = GatewayServicer(gw)
            rpc.set_serving(self.health, ["", SERVICE_NAME], True)
            threading.Thread(target=self._follow_readiness, args=(gw,), name="crossdraft-readiness",
                             daemon=True).start()
            if self.memtrace is not None:
                self.memtrace.start()
            print(f"crossdraft gateway: ready (target {gw.model_name}, drafter "
                  f"{gw.drafter_model or 'none'}); REST {self.scheme}://{cfg.host}:{cfg.http_port}/v1, "
                  f"gRPC {cfg.host}:{self.grpc_port}", flush=True)
        except Exception as e:
            log.error("gateway failed to start: %s: %s", type(e).__name__, e)
            self.rc = 1
            self.http.should_exit = True

    def _follow_readiness(self, gw) -> None:
        """The gateway's own gRPC health says what /readyz says."""
        from crossdraft.serving import rpc

        last = True
        while not self.http.should_exit and not gw.draining:
            ok, _ = gw.readiness()
            if ok != last:
                rpc.set_serving(self.health, ["", SERVICE_NAME], ok)
                last = ok
            time.sleep(1.0)

    def drain(self, gw) -> None:
        """Not ready and no new generations at once (503 / UNAVAILABLE, gRPC health NOT_SERVING);
        the servers stop once in-flight requests end, or after --drain-timeout-s."""
        from crossdraft.serving import rpc

        cfg = self.cfg
        gw.draining = True
        rpc.set_serving(self.health, ["", SERVICE_NAME], False)
        print(f"crossdraft gateway: draining ({gw.admission.active} requests in flight, up to "
              f"{cfg.drain_timeout_s:g} s)", flush=True)

        def wait_idle():
            idle = gw.admission.wait_idle(cfg.drain_timeout_s)
            print(f"crossdraft gateway: {'drained' if idle else 'drain timeout'}; stopping", flush=True)
            # not handle_exit(): uvicorn would re-raise the signal after shutdown (exit by signal,
            # not 0); a drained gateway exits normally
            self.http.should_exit = True

        threading.Thread(target=wait_idle, name="crossdraft-drain", daemon=True).start()


__all__ = ["build_gateway", "main"]
