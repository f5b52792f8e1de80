#!/usr/bin/env bash
# One H200 session: GPU tests, whole-model and family benchmarks with a profile, kernel benchmarks.
# From the repo root on the device machine: bash benchmarks/gpu_session.sh   (results under $OUT)
# Steps run in priority order, each under its own time limit (SIGABRT at the limit: a Python run with -X faulthandler
# prints where it stood), all logging into $OUT/session_log.txt.
# STEPS="tests model" (names: tests model families model32k decode ablate indexer sparse moe norm hc fuzz, and for
# released-layout checkpoints qlinears qdecode qgenerate qdistributed) runs a subset;
# MODEL_CONFIGS / MODEL_SEQ / MODEL_LOGITS, DECODE_CONFIGS / DECODE_CONTEXT / DECODE_LIMIT and ABLATE_LIMIT narrow
# the model steps.
set -uo pipefail
export OUT=${OUT:-/tmp/dsfuse_out}
mkdir -p "$OUT"
LOG="$OUT/session_log.txt"
export PYTHONUNBUFFERED=1
# A snapshot made by `git archive` has no .git: its commit comes in a .commit file beside it.
[[ -f .commit ]] && export DSFUSE_COMMIT=$(cat .commit)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -1
STEPS=${STEPS:-tests model families model32k decode ablate indexer sparse moe norm hc fuzz}
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step SECONDS TITLE COMMAND...
  local limit=$1 title=$2; shift 2
  echo "=== $title ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  timeout -s ABRT "$limit" "$@" 2>&1 | grep -v -i -E "warn|^\s*$" | tail -"${TAIL:-40}" | tee -a "$LOG"
}
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader | tee -a "$LOG"

wanted tests && TAIL=15 step 150 "GPU tests" python3 -P -m pytest -q -m gpu tests/kernels
wanted model && TAIL=80 step 220 "model prefill S=2048/8192" python3 -m dsfuse.bench model --preset v32-real-2l \
  --seq ${MODEL_SEQ:-2048 8192} --logits ${MODEL_LOGITS:-all} --rep-ms 500 --profile \
  --configs ${MODEL_CONFIGS:-eager,inductor,dsfuse-off,dsfuse,only:indexer_topk,only:sparse_attention} \
  --json "$OUT/model.json"
wanted families && TAIL=14 step 120 "families at real shapes" python3 -m dsfuse.bench families \
  --json "$OUT/families.json"
wanted model32k && TAIL=20 step 90 "model prefill S=32768 (dsfuse only)" python3 -m dsfuse.bench model \
  --preset v32-real-2l --seq 32768 --rep-ms 300 --profile --configs dsfuse --json "$OUT/model_32k.json"
wanted decode && TAIL=30 step ${DECODE_LIMIT:-300} "model decode with a KV cache" python3 -m dsfuse.bench model \
  --preset v32-real-2l --mode decode --decode-batch 1 8 --context ${DECODE_CONTEXT:-8192 32768} \
  --configs ${DECODE_CONFIGS:-eager,inductor,dsfuse,inductor-cudagraphs,dsfuse-cudagraphs} --prefill-cache dsfuse --profile --rep-ms 300 \
  --json "$OUT/decode.json" --markdown "$OUT/decode.md"
wanted ablate && TAIL=40 step ${ABLATE_LIMIT:-240} "ablation S=8192" python3 -m dsfuse.bench ablate --preset v32-real-2l --seq 8192 \
  --rep-ms 300 --json "$OUT/ablate.json" --markdown "$OUT/ablate.md"
wanted indexer && TAIL=12 step 90 "indexer_topk kernels" python3 -P benchmarks/indexer_topk_gpu.py
wanted sparse && TAIL=16 step 110 "sparse attention kernels" python3 -P benchmarks/sparse_attention_gpu.py
wanted moe && TAIL=16 step 120 "moe_experts kernels" python3 -P benchmarks/moe_experts_gpu.py
wanted norm && TAIL=12 step 60 "norm_rope_quant kernels" python3 -P benchmarks/norm_rope_quant_gpu.py
wanted hc && TAIL=14 step 300 "hyper-connection kernels" python3 -P benchmarks/hyper_connections_gpu.py
# Released-layout checkpoints (random weights at real dimensions, written here): the FP8 / FP4 linears at decode
# sizes with their tile sweep; the V3.2 decode step, FP8 against bf16; `generate` ms/step with one decode step's GPU
# time by kernel and host time by function, V3.2 FP8 and V4-Flash FP4 each beside its bf16 model.
checkpoint() {  # checkpoint PRESET DIR
  [[ -d $2 ]] || TAIL=3 step 150 "write $1 in its released layout" python3 -m dsfuse.bench checkpoint --preset $1 --out $2
}
wanted qlinears && TAIL=60 DECODE_ONLY=1 DECODE_SWEEP=1 step 240 "FP8 / FP4 linears at decode sizes, tile sweep" \
  python3 -P benchmarks/fp8_linear_gpu.py
if wanted qdecode; then
  checkpoint v32-real-2l /tmp/v32fp8
  for source in "--checkpoint /tmp/v32fp8" "--preset v32-real-2l"; do
    TAIL=30 step 150 "decode step B=1 T=8192, CUDA graphs: $source" python3 -m dsfuse.bench model $source --mode decode \
      --decode-batch 1 --context 8192 --configs dsfuse-cudagraphs --profile --rep-ms 300 \
      --json "$OUT/qdecode_${source##*[ /]}.json"
  done
fi
if wanted qgenerate; then
  checkpoint v32-real-2l /tmp/v32fp8
  checkpoint v4-flash-real-2l /tmp/v4fp4
  for source in "--checkpoint /tmp/v32fp8" "--preset v32-real-2l" "--checkpoint /tmp/v4fp4" "--preset v4-flash-real-2l"; do
    TAIL=12 step 200 "generate prompt 8192, 64 tokens: $source" python3 -X faulthandler -m dsfuse.bench generate \
      $source --prompt 8192 --batch 1 --new-tokens 64 --configs dsfuse --repeats 2 --profile \
      --json "$OUT/qgenerate_${source##*[ /]}.json"
  done
fi
if wanted qdistributed; then  # a machine with several GPUs: the released FP8 layout sharded, tensor and expert parallel
  checkpoint v32-real-2l /tmp/v32fp8
  gpus=$(nvidia-smi -L | wc -l)
  TAIL=12 step 300 "sharded FP8 prefill on $gpus GPUs" torchrun --nproc_per_node $gpus \
    benchmarks/distributed_prefill.py --checkpoint /tmp/v32fp8 --ep --seq 2048 8192 --json "$OUT/qdistributed.json"
fi
# fuzz: the op fuzz suite with the gpu profile, file by file under their own limits (table in $OUT/op_fuzz.md, each
# file's log in $OUT/op_fuzz_logs), FUZZ_OPS_JOBS files at once; then whole presets at many lengths and batch sizes
wanted fuzz && TAIL=15 step ${FUZZ_OPS_LIMIT:-360} "op fuzz (gpu profile)" python3 -P benchmarks/op_fuzz_gpu.py \
  --jobs ${FUZZ_OPS_JOBS:-4} --out "$OUT"
wanted fuzz && TAIL=40 step ${FUZZ_MODEL_LIMIT:-480} "model fuzz" python3 -P benchmarks/model_fuzz_gpu.py --out "$OUT"
true
