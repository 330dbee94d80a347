#!/usr/bin/env bash
# Every GPU check of crossdraft in one run, for a machine with one CUDA GPU and no internet
# (torch, transformers and grpcio installed; the repository's working tree as the current folder).
# Results go to $OUT (default ./gpu-out); each step has its own time limit so that one slow step
# does not eat the others' time. Total: ~8 minutes on an H200.
#   bash scripts/gpu-checks.sh
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ ! -f crossdraft/v1/__init__.py ]; then  # gRPC stubs (generated, not committed)
  python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/crossdraft/v1/*.proto \
    && touch crossdraft/v1/__init__.py
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
rc=0
# 1. CUDA graphs: fp32 replays equal eager forwards (exit 1 otherwise), bf16 step times eager vs graph
timeout 150 python benchmarks/gpu_graphs_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_graphs_check.log" || rc=1
# 2. one batched verification forward, B = 1..64 sessions, 8B-shaped target (bf16)
timeout 120 python benchmarks/gpu_verify_batch.py --out "$OUT" 2>&1 | tee "$OUT/gpu_verify_batch.log" || rc=1
# 3. the verifier worker as the gRPC handlers drive it: graphs / batched eager / one at a time
timeout 240 python benchmarks/gpu_worker_concurrency.py --out "$OUT" --clients 1,8,32 --rounds 10 \
  2>&1 | tee "$OUT/gpu_worker_concurrency.log" || rc=1
exit $rc
