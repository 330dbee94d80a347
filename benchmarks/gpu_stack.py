"""Benchmark: the whole stack on one machine (a GPU, or a CPU dry run), 1 and 16 clients, target-only
vs drafting, with each round's time split into the models' own time, their queue waits and overhead.

Built for a machine without network: the models are random-initialised in real shapes on the device
(``--shapes qwen7b``: a Qwen2.5-7.6B-shaped target, ~30 s to build and save on an H200; ``tiny`` for a
CPU dry run) with the real Qwen tokenizer files beside them (``--tokenizer DIR``: default, the catalog's
qwen2.5-coder-0.5b when it is pulled). Random weights draft nothing useful, so the drafter is an
early-exit copy of the target: its embeddings, first ``--draft-layers`` layers, final norm and head.
The copy predicts the target's tokens as often as the target's later layers leave its choice alone:
they are scaled down (``--tail-scale``, the output projections of the layers past the drafter's) to
give an acceptance like a good drafter's (the JSON says what it measured).

Then ``crossdraft up`` starts Redis, both model servers and the gateway (``--device``), and REST clients
send greedy requests of ``--max-new-tokens``: at each client count, target-only (use_drafter=false),
drafting 4 tokens every round, and drafting as the chooser decides (adaptive), side by side. Per point:
tokens/s, ms per round and its parts (the stats' draft_ms, verify_ms, draft_queue_ms + verify_queue_ms,
overhead_ms, over rounds), acceptance. Writes <out>/gpu-stack-<machine class>.json and prints a table.

Usage: python benchmarks/gpu_stack.py --out DIR [--device cuda] [--shapes qwen7b|tiny] [--clients 1,16]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {
    # Qwen2.5-7B (the 7.6B-parameter instruct/coder shape)
    "qwen7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768),
    # a CPU dry run of the same script
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096),
}
PROMPTS = ["def quicksort(arr):\n", "The history of the printing press", "import numpy as np\n\ndef",
           "Once upon a time, in a small village", "class Stack:\n    def __init__(self):\n",
           "Explain how a hash map works.", "SELECT name FROM users WHERE", "fn main() {\n"]


def default_tokenizer() -> Path | None:
    from crossdraft.home import crossdraft_home

    d = crossdraft_home() / "models" / "qwen2.5-coder-0.5b"
    return d if (d / "tokenizer.json").exists() else None


def build_models(out: Path, shape: str, draft_layers: int, device: str, dtype, tokenizer: Path,
                 tail_scale: float) -> tuple[Path, Path]:
    """A random-initialised target of `shape` and its early-exit copy as drafter, saved with the tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPES[shape], rope_theta=1e6, tie_word_embeddings=False, torch_dtype=dtype,
                      bos_token_id=151643, eos_token_id=151643)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen2ForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # the layers past the drafter's change the residual stream by tail_scale of theirs
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(tail_scale)
            layer.mlp.down_proj.weight.mul_(tail_scale)
        # logits of a standard deviation of ~12 (a random head gives ~0.02 sqrt(hidden)): both models are as
        # sure of their choices as trained ones, so that the drafter's blocks do not end on its doubt
        target.lm_head.weight.mul_(12.0 / (cfg.initializer_range * cfg.hidden_size ** 0.5))
    t_dir, d_dir = out / f"target-{shape}", out / f"drafter-{shape}-{draft_layers}l"
    target.save_pretrained(t_dir)
    dcfg = Qwen2Config(**{**SHAPES[shape], "num_hidden_layers": draft_layers}, rope_theta=1e6,
                       tie_word_embeddings=False, torch_dtype=dtype, bos_token_id=151643, eos_token_id=151643)
    with torch.device("meta"):
        drafter = Qwen2ForCausalLM(dcfg)
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < draft_layers}
    drafter.load_state_dict(state, assign=True)
    drafter.save_pretrained(d_dir)
    del target, drafter, state
    for d in (t_dir, d_dir):
        for f in tokenizer.iterdir():
            if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "chat_template")):
                shutil.copy(f, d / f.name)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    print(f"models built and saved in {time.perf_counter() - t0:.1f} s: {t_dir.name}, {d_dir.name}", flush=True)
    return t_dir, d_dir


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import requests

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"crossdraft up exited with {proc.returncode}")
        try:
            if requests.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the stack was not ready after {timeout_s} s")


def scrape(port: int) -> dict[str, float]:
    """A model server's Prometheus samples (name{labels} -> value); {} when it does not answer."""
    import requests

    try:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except requests.RequestException:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def batching(kind: str, before: dict, after: dict) -> dict:
    """What a point's forwards were on one model server: how many, rows per forward, CUDA graph replays."""
    def d(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    n = d(f"crossdraft_{kind}_batch_rows_count")
    return {"forwards": int(n), "rows_per_forward": round(d(f"crossdraft_{kind}_batch_rows_sum") / n, 2) if n else 0.0,
            "graph_replays": int(d(f"crossdraft_{kind}_cuda_graphs_replays"))}


MODES = {  # mode -> request fields
    "target-only": {"use_drafter": False},
    "drafting": {"use_drafter": True, "adaptive_draft": False, "num_draft_tokens": 4},  # every round drafts 4
    "adaptive": {"use_drafter": True},  # the chooser decides (what users get)
}


def point(url: str, clients: int, requests_each: int, max_new_tokens: int, mode: str) -> dict:
    """`clients` threads, each sending `requests_each` greedy requests; aggregate tokens/s and round parts."""
    import requests

    stats, tokens, errors = [], [0], []
    lock = threading.Lock()

    def client(i: int) -> None:
        s = requests.Session()
        for j in range(requests_each):
            body = {"prompt": PROMPTS[(i + j) % len(PROMPTS)], "max_tokens": max_new_tokens, "temperature": 0,
                    **MODES[mode]}
            try:
                r = s.post(f"{url}/v1/completions", json=body, timeout=600)
                r.raise_for_status()
                doc = r.json()
            except Exception as e:  # noqa: BLE001 -- reported in the result
                with lock:
                    errors.append(repr(e)[:200])
                continue
            with lock:
                stats.append(doc.get("speculative") or {})
                tokens[0] += doc["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    rounds = sum(s.get("rounds", 0) for s in stats) or 1

    def per_round(*keys):
        return round(sum(sum(s.get(k, 0.0) for k in keys) for s in stats) / rounds, 3)

    drafted = sum(s.get("drafted", 0) for s in stats)
    return {"clients": clients, "mode": mode, "requests": len(stats),
            "tokens": tokens[0], "wall_s": round(wall, 3), "tokens_per_s": round(tokens[0] / wall, 2),
            "ms_per_round": round(sum(s.get("total_ms", 0.0) - s.get("prefill_ms", 0.0) for s in stats) / rounds, 3),
            "verify_ms": per_round("verify_ms"), "draft_ms": per_round("draft_ms"),
            "queue_ms": per_round("draft_queue_ms", "verify_queue_ms"), "overhead_ms": per_round("overhead_ms"),
            "tokens_per_round": round(tokens[0] / rounds, 3),
            "acceptance": round(sum(s.get("accepted", 0) for s in stats) / drafted, 3) if drafted else 0.0,
            "errors": errors[:5]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="qwen7b")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--tail-scale", type=float, default=0.1,
                    help="the target's layers past the drafter's have their output projections scaled by this: "
                         "the smaller, the more often the early-exit copy drafts the target's token")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--clients", default="1,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per point")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--ready-timeout-s", type=float, default=180)
    a = ap.parse_args()

    import torch

    from benchmarks.machineclass import machine_class

    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    tok = a.tokenizer or default_tokenizer()
    if tok is None:
        sys.exit("no tokenizer: pass --tokenizer DIR (a Qwen2.5 tokenizer's files), or `make models` first")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="crossdraft-gpu-stack-"))
    t_dir, d_dir = build_models(work, a.shapes, a.draft_layers, a.device, dtype, tok, a.tail_scale)
    http, grpc_port = free_port(), free_port()
    dname = str(dtype).replace("torch.", "")
    cmd = [sys.executable, "-m", "crossdraft.cli", "up", "--target", str(t_dir), "--drafter", str(d_dir),
           "--device", a.device, "--target-dtype", dname, "--drafter-dtype", dname, "--http-port", str(http),
           "--grpc-port", str(grpc_port), "--drafter-port", str(free_port()), "--verifier-port", str(free_port()),
           "--log-dir", str(out / "stack-logs"), "--ready-timeout-s", str(a.ready_timeout_s)]
    metrics = {"drafter": free_port(), "verifier": free_port()}  # each model server's batching, per point
    cmd += ["--drafter-metrics-port", str(metrics["drafter"]), "--verifier-metrics-port", str(metrics["verifier"])]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    url = f"http://127.0.0.1:{http}"
    points = []
    try:
        wait_ready(url, proc, a.ready_timeout_s)
        print(f"stack ready in {time.perf_counter() - t0:.1f} s", flush=True)
        for mode in MODES:  # warm-up (graphs, masks), not counted
            point(url, 1, 1, 8, mode)
        for c in [int(x) for x in a.clients.split(",") if x]:
            for mode in MODES:
                before = {k: scrape(port) for k, port in metrics.items()}
                p = point(url, c, a.requests, a.max_new_tokens, mode)
                for k, port in metrics.items():
                    p[k] = batching(k, before[k], scrape(port))
                points.append(p)
                print(f"{c:3d} clients {p['mode']:12} {p['tokens_per_s']:8.1f} tok/s  {p['ms_per_round']:7.2f} ms/round"
                      f"  verify {p['verify_ms']:6.2f}  draft {p['draft_ms']:6.2f}  queue {p['queue_ms']:6.2f}  "
                      f"overhead {p['overhead_ms']:5.2f}  tokens/round {p['tokens_per_round']:.2f}  "
                      f"acceptance {p['acceptance']:.2f}  rows/forward: drafter {p['drafter']['rows_per_forward']}"
                      f" verifier {p['verifier']['rows_per_forward']}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    from bench import _cpu_name, git_commit

    device = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else _cpu_name()
    doc = {"benchmark": "gpu-stack", "device": device, "shapes": a.shapes, "draft_layers": a.draft_layers,
           "tail_scale": a.tail_scale,
           "dtype": dname, "max_new_tokens": a.max_new_tokens, "api": "REST, greedy",
           "drafter": f"early-exit copy of the random-initialised target ({a.draft_layers} layers + its head)",
           "python": platform.python_version(), "torch": torch.__version__, "meta": git_commit(), "points": points}
    path = out / f"gpu-stack-{machine_class()}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    main()
