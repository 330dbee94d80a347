#!/usr/bin/env bash
# The whole stack on one GPU in one call of <= 5 minutes, for a machine without network
# (benchmarks/gpu_stack.py: random-initialised Qwen2.5-7.6B-shaped target and an early-exit copy of it as
# drafter, `crossdraft up --device cuda`, 1 and 16 REST clients, target-only vs drafting). Results go to
# $OUT (default ./gpu-out). On a machine that lacks the stack's packages, carry .cache/gpu-carry
# (scripts/gpu-prepare.sh) with the working tree: they are installed into /tmp/site for this run only.
# A CPU dry run of the same steps: DEVICE=cpu SHAPES=tiny CLIENTS=1,2 bash scripts/gpu-stack.sh
set -u
OUT=${OUT:-gpu-out}
CARRY=${CARRY:-.cache/gpu-carry}
mkdir -p "$OUT"
PY=${PYTHON:-python}
if ! "$PY" -c "import starlette, uvicorn, redis, opentelemetry.sdk, grpc_health, grpc_reflection" 2>/dev/null; then
  [ -d "$CARRY/wheels" ] || { echo "missing packages and no $CARRY/wheels (scripts/gpu-prepare.sh)"; exit 2; }
  "$PY" -m pip install -q --no-deps --no-index --target /tmp/site "$CARRY"/wheels/*.whl || exit 2
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import crossdraft.v1.drafter_pb2_grpc" 2>/dev/null; then  # stubs for this machine's grpcio
  "$PY" -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/crossdraft/v1/*.proto \
    && touch crossdraft/v1/__init__.py || exit 2
fi
tok=()
[ -d "$CARRY/tokenizer" ] && tok=(--tokenizer "$CARRY/tokenizer")
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true; } > "$OUT/device.txt"
timeout "${LIMIT_S:-280}" "$PY" benchmarks/gpu_stack.py --out "$OUT" --device "${DEVICE:-cuda}" \
  --shapes "${SHAPES:-qwen7b}" --clients "${CLIENTS:-1,16}" --max-new-tokens "${TOKENS:-96}" "${tok[@]}" \
  2>&1 | tee "$OUT/gpu_stack.log"
exit "${PIPESTATUS[0]}"
