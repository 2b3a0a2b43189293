#!/bin/bash
# The H200 zoo table (docs/frontends.md, "The whole zoo on the H200"): all 52 rows, 13 models x
# fp32/bf16 x batch 1/8 (dynamo exports), each plan verified against the float64 reference (and
# onnxruntime in fp32) before it is timed, next to torch eager, torch.compile default and
# reduce-overhead, and jax.jit. Three parts, each sized for one 9-minute device call:
#
#   bash benchmarks/zoo_h200_fill.sh 1 COMMIT   # 26 rows: batch 1, fp32 and bf16
#   bash benchmarks/zoo_h200_fill.sh 2 COMMIT   # 13 rows: batch 8, bf16
#   bash benchmarks/zoo_h200_fill.sh 3 COMMIT   # 13 rows: batch 8, fp32
#
# Run from the checkout's root with tunedb's dependencies (and torch, jax) installed; WHEELS=DIR
# installs a folder of wheels first. Results go to $OUT/zoo_h200_partN.json (+ .log); the table:
#   python benchmarks/zoo_table.py zoo_h200_part1.json zoo_h200_part2.json zoo_h200_part3.json
# TIME_LIMIT (default 400 s) stops the part; a row not finished by then is recorded as such.
set -u
PART=${1:?usage: zoo_h200_fill.sh PART(1|2|3) [COMMIT]}
OUT=${OUT:-$(mktemp -d)}
if [ -n "${WHEELS:-}" ]; then
  SITE=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl || exit 3
  export PYTHONPATH=$SITE:$PWD
fi
export TUNEDB_GIT_COMMIT=${2:-$(git rev-parse HEAD 2>/dev/null)} PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2
MODELS="bert_base distilbert gpt2 llama_small t5_encoder vit clip_text clip_vision whisper_encoder
        resnet50 mobilenet_v3 efficientnet_b0 convnext_tiny"
FILES=()
for m in $MODELS; do
  case $PART in
    1) FILES+=(data/graphs/zoo/${m}_dynamo_bf16.onnx data/graphs/zoo/${m}_dynamo_fp32.onnx) ;;
    2) FILES+=(data/graphs/zoo_b8/${m}_dynamo_bf16_b8.onnx) ;;
    3) FILES+=(data/graphs/zoo_b8/${m}_dynamo_fp32_b8.onnx) ;;
    *) echo "error: PART is 1, 2 or 3, not '$PART'" >&2; exit 2 ;;
  esac
done
for f in "${FILES[@]}"; do [ -f "$f" ] || { echo "error: $f is missing" >&2; exit 2; }; done
[ -n "${LIST:-}" ] && { printf '%s\n' "${FILES[@]}"; exit 0; }  # LIST=1: the part's files only
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv > "$OUT/gpu_part$PART.txt" 2>&1
# 10 workers on the 16-core host: compilations overlap, every timing holds the lock.
timeout $(( ${TIME_LIMIT:-400} + 50 )) python3 benchmarks/bench_zoo_plan.py "$OUT/zoo_h200_part$PART.json" \
  --workers 10 --time-limit "${TIME_LIMIT:-400}" --target-s 0.05 --gpu-lock "$OUT/gpu.lock" \
  "${FILES[@]}" > "$OUT/zoo_h200_part$PART.log" 2>&1
echo "part $PART rc=$?"
tail -n 30 "$OUT/zoo_h200_part$PART.log"
