"""Replay draft-length policies on recorded greedy acceptance traces (no models, deterministic).

Under greedy decoding a round's outcome is fixed by the text: at generated position i the drafter
proposes its argmax after the (correct) prefix, and a block starting at i is accepted up to the
first position whose argmax differs from the target's token. So one teacher-forced drafter forward
over the target's own greedy output records, per position, whether the drafter's argmax matches
(``match``) and how sure the drafter was (``conf``, its top probability). Any policy can then be
replayed exactly -- which block sizes it picks, where the drafter's doubt ends a block, what it
accepts -- and priced with the model servers' cost tables (drafter step and target forward over m
tokens, in target decoding steps). The figure is the speedup over target-only in those units.

This measures the policy alone: forward costs are the tables' (the real run adds round overheads
and noise), and drafts after a block's first mismatch are priced but never accepted, as in a
real round. Recording needs the models; replaying needs only the JSON.

    python benchmarks/policy_replay.py --record tests/data/traces/qwen-0.5b-for-1.5b.json   # ~4 min
    python benchmarks/policy_replay.py tests/data/traces/qwen-0.5b-for-1.5b.json             # table
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from crossdraft.decoding.policy import DraftConfig, DraftPolicy  # noqa: E402


def replay(trace: dict, cfg: DraftConfig, drafter_ms: list[float], target_ms: list[float],
           confident: bool = True, carry: dict | None = None) -> dict:
    """One generation replayed: the policy as the round loop drives it (decode.py), greedy,
    measured costs that match their predictions exactly. Returns speedup, drafted, accepted, rounds."""
    match, conf = trace["match"], trace["conf"]
    n_tok = len(match)
    c = drafter_ms[0] / target_ms[0]
    v = [x / target_ms[0] for x in target_ms]
    pol = DraftPolicy(cfg, c, verify_costs=target_ms, measured=True, drafter_costs=drafter_ms)
    pol.confident = confident and cfg.adaptive
    if carry:  # what the decoder carries from one request to the next (the probes' record)
        pol.hit_s, pol.hit_n, pol.probe_sum, pol.probe_n = carry["probes"]
    k = pol.hi if pol.confident else cfg.num_draft_tokens
    # as the round loop starts a request (crossdraft.decoding.decode.Decoder._start), one session alone (the
    # traces do not record the prompt's length: its drafter prefill is priced as one token)
    if cfg.adaptive and cfg.allow_skip and not (pol.could_pay() and pol.worth_probing(len(match))):
        k = 0
        pol.interval = pol.wait = pol.max_probe_every if not pol.could_pay() else pol.probe_pace()
    i = drafted = accepted = rounds = 0
    cost = 0.0
    while i < n_tok:
        kk = min(k, n_tok - i - 1)
        tau = pol.cumulative_stop() if pol.confident or cfg.stop_cumulative else 0.0
        kd, cum = 0, 1.0
        for j in range(max(0, kk)):  # the drafter's block: ends on its own doubt
            kd += 1
            cum *= conf[i + j]
            if conf[i + j] < cfg.stop_below or cum < tau:
                break
        n = 0
        while n < kd and match[i + n]:
            n += 1
        cost += kd * c * pol.costs.dcost(1) + v[min(kd + 1, len(v)) - 1]
        drafted, accepted, rounds = drafted + kd, accepted + n, rounds + 1
        pol.observe(kd, n)
        i += n + 1
        if i < n_tok:
            k = pol.next_k(n_tok - i)
    if carry is not None:
        carry["probes"] = (pol.hit_s, pol.hit_n, pol.probe_sum, pol.probe_n)
    return {"speedup": n_tok / cost, "drafted": drafted, "accepted": accepted, "rounds": rounds}


def summary(traces: list[dict], cfg: DraftConfig, drafter_ms, target_ms, confident=True) -> dict:
    carry: dict = {}  # the traces one after the other, as one decoder serves them
    rs = [replay(t, cfg, drafter_ms, target_ms, confident, carry) for t in traces]
    return {"gmean": statistics.geometric_mean([r["speedup"] for r in rs]),
            "min": min(r["speedup"] for r in rs), "runs": rs,
            "drafted": sum(r["drafted"] for r in rs), "accepted": sum(r["accepted"] for r in rs)}


def scaled(drafter_ms: list[float], target_ms: list[float], c: float) -> list[float]:
    """The drafter's table rescaled so that one step costs c target steps (what-if costs)."""
    f = c * target_ms[0] / drafter_ms[0]
    return [x * f for x in drafter_ms]


def record(out: Path, target: str, drafter: str, n_prompts: int, max_new: int, quantize: str = "none") -> None:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench  # noqa: E402

    from crossdraft.engine import Engine
    from crossdraft.models import loading as M
    from crossdraft.runtime import costs

    prompts = bench.prompt_set("humaneval+mixed", n_prompts)
    t = M.load_model(target, dtype=M.fast_dtype("cpu"))
    d = M.load_model(drafter, dtype=M.fast_dtype("cpu"), quantize=quantize)
    if d.quantize == "int8":  # teacher-forced: every row through the int8 kernel, as the drafter's steps run
        from crossdraft.models import quant

        quant.set_max_rows(d.model, 1 << 30)
    if t.tokenizer.get_vocab() != d.tokenizer.get_vocab():
        raise SystemExit("recording needs a same-vocabulary pair (a teacher-forced drafter must read the target's ids)")
    base = Engine(t)
    rows = []
    for label, p in prompts:
        gen = base.generate(p, max_new_tokens=max_new).token_ids
        ids = list(t.tokenizer(p)["input_ids"])
        with torch.no_grad():
            pr = torch.softmax(d.model(torch.tensor([ids + list(gen)])).logits[0].float(), dim=-1)
        top = pr.max(dim=-1)
        at = [len(ids) + j - 1 for j in range(len(gen))]
        rows.append({"label": label, "match": [int(top.indices[a]) == g for a, g in zip(at, gen, strict=True)],
                     "conf": [round(float(top.values[a]), 5) for a in at]})
        print(f"{label:10} {sum(rows[-1]['match'])}/{len(gen)} drafter argmax == target token", flush=True)
    data = {"target": target, "drafter": drafter, "dtype": str(t.dtype), "git": bench.git_commit(),
            "drafter_quantize": d.quantize, "drafter_ms": costs.forward_ms(d, 17),
            "target_ms": costs.forward_ms(t, 17), "traces": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", type=Path)
    ap.add_argument("--record", action="store_true", help="record the traces file (needs the models)")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", type=int, default=8, help="per prompt set (HumanEval + mixed)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafter-quantize", default="none", choices=("none", "int8"),
                    help="record with the drafter's int8 weights (crossdraft/models/quant.py)")
    a = ap.parse_args()
    if a.record:
        record(a.traces, a.target, a.drafter, a.prompts, a.max_new_tokens, a.drafter_quantize)
        return
    data = json.loads(a.traces.read_text())
    traces, dm, tm = data["traces"], data["drafter_ms"], data["target_ms"]
    print(f"{data['drafter']} ({data.get('drafter_quantize', 'none')} weights) drafting for {data['target']} "
          f"({data['dtype']}), {len(traces)} prompts; "
          f"drafter step = {dm[0] / tm[0]:.2f} target steps as recorded")
    base = DraftConfig()
    for c in (dm[0] / tm[0], 0.15, 0.3, 0.6, 0.8):
        d = scaled(dm, tm, c)
        print(f"c = {c:.2f}")
        for name, cfg, conf in [("confident (default greedy)", base, True),
                                ("per-round k (acceptance model)", replace(base, stop_cumulative=0.0), False)] + [
                                (f"fixed k={k}", replace(base, adaptive=False, num_draft_tokens=k), False)
                                for k in (2, 4, 8)]:
            s = summary(traces, cfg, d, tm, conf)
            print(f"  {name:32} {s['gmean']:.3f}x (worst prompt {s['min']:.2f}x)  "
                  f"accepted {s['accepted']}/{s['drafted']}")


if __name__ == "__main__":
    main()
