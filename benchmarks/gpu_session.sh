#!/usr/bin/env bash
# One H200 session: GPU tests, whole-model benchmark with a profile, kernel benchmarks, graph dumps.
# Usage on the device machine, from the repo root: bash benchmarks/gpu_session.sh  (writes into $OUT)
set -uo pipefail
export OUT=${OUT:-/tmp/dsfuse_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null || true

timeout 100 python3 -P -m pytest -q -m gpu tests 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
timeout 220 python3 -m dsfuse.bench model --preset v32-real-2l --seq 2048 8192 --rep-ms 500 --profile \
  --configs eager,inductor,dsfuse-off,dsfuse,only:indexer_topk,only:sparse_attention \
  --json "$OUT/model.json" 2>&1 | grep -v -i warn | tee "$OUT/model_log.txt"
timeout 90 python3 -P benchmarks/indexer_topk_gpu.py 2>&1 | tail -9 | tee "$OUT/indexer_log.txt"
timeout 90 python3 -P benchmarks/sparse_attention_gpu.py 2>&1 | tail -12 | tee "$OUT/sparse_log.txt"
timeout 60 python3 -P benchmarks/dump_post_grad.py --out "$OUT" 2>&1 | tail -1
