"""Token healing A/B: acceptance of text drafting with and without healing, side by side.

Fixed blocks (k = 4, no adaptive policy) so that both arms draft in every round and the only
difference is healing (crossdraft.vocab.healing); acceptance and target tokens per round are the
measures (a round's forwards are the same in both arms: healing adds none). Greedy, in process.

Usage: python benchmarks/healing_ab.py [--target qwen2.5-coder-1.5b] [--drafters smollm2-135m,gemma3-270m]
       [--humaneval 8] [--mixed 4] [--max-new-tokens 40]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import MIXED_PROMPTS, git_commit, humaneval_prompts  # noqa: E402

from crossdraft.engine import DraftConfig, Engine  # noqa: E402
from crossdraft.models.loading import fast_dtype, load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafters", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--humaneval", type=int, default=8)
    ap.add_argument("--mixed", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    a = ap.parse_args()
    print(git_commit(), flush=True)
    target = load_model(a.target, dtype=fast_dtype("cpu"))
    prompts = humaneval_prompts(a.humaneval) + [p for _, p in MIXED_PROMPTS[: a.mixed]]
    for name in [d for d in a.drafters.split(",") if d]:
        eng = Engine(target, load_model(name, dtype=fast_dtype("cpu")))
        for heal in (False, True):
            acc = drafted = rounds = tokens = healed = 0
            t0 = time.perf_counter()
            for p in prompts:
                s = eng.generate(p, max_new_tokens=a.max_new_tokens,
                                 draft=DraftConfig(num_draft_tokens=4, adaptive=False, mode="text", heal=heal)).stats
                acc, drafted, rounds = acc + s.accepted, drafted + s.drafted, rounds + s.rounds
                tokens, healed = tokens + s.new_tokens, healed + s.healed
            print(f"{name:20s} {'healing' if heal else 'no healing':10s} accepted {acc}/{drafted} "
                  f"({acc / max(1, drafted):.3f})  target tokens per round {tokens / max(1, rounds):.3f}  "
                  f"healed blocks {healed}/{rounds}  {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
