#!/bin/bash
# Issue 20 on one H200, sized for one 9-minute device call, from the checkout's root:
#  1. the stage bench: Inception V3 b1, SqueezeNet 1.1, NASNet-A- and RandWire-style graphs at
#     batch 1 and 16: sequential, IOS, auto, refined and full-oracle plans (b1), each verified
#     first, then torch.compile reduce-overhead, JAX and default torch.compile at b1 and b16
#     (peers last; --budget-s stops new work, the JSON is rewritten after every case);
#  2. the GPU tests of stages (the stage collector timing every candidate of a small graph);
#  3. on the CPU, the refinement loop replayed against the new rows, next to their oracle.
# Results go to $OUT: stages_h200_v3.json, stages_h200_v3_rows.json, stages_replay_v3.json, logs.
# BENCH_S / TESTS_S bound steps 1 and 2 in seconds (defaults fit 540 s with the replay).
set -u
T0=$SECONDS
. "$(dirname "$0")/gpu_call_env.sh"
BENCH_S=${BENCH_S:-420}
timeout "$BENCH_S" $PY -m tunedb.bench.stages "$OUT/stages_h200_v3.json" --peers --refine --oracle=full \
  --budget-s=$((BENCH_S - 90)) > "$OUT/bench.log" 2>&1
echo "bench rc=$? at $((SECONDS-T0))s"; tail -n 40 "$OUT/bench.log"
timeout "${TESTS_S:-80}" $PY -m pytest -q -m gpu tests/test_stages_gpu.py > "$OUT/tests.log" 2>&1
echo "gpu tests rc=$? at $((SECONDS-T0))s"; tail -n 5 "$OUT/tests.log"
if [ -f "$OUT/stages_h200_v3_rows.json" ]; then
  timeout 60 $PY -m tunedb.bench.stages "$OUT/stages_replay_v3.json" \
    --replay="$OUT/stages_h200_v3_rows.json" > /dev/null 2> "$OUT/replay.err"
  echo "replay rc=$? at $((SECONDS-T0))s"
fi
$PY - "$OUT/stages_h200_v3.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
print("| graph | sequential | ios | auto | refined | oracle | torch.compile RO | JAX | torch.compile |")
for name, r in doc["cases"].items():
    us = lambda k: (r.get(k) or {}).get("us")
    peer = lambda p: (r.get("peers", {}).get(p) or {}).get("us")
    cells = [us("sequential"), us("ios"), (r.get("auto") or {}).get("us"), us("ios_refined"), us("ios_oracle"),
             peer("torch_compile_ro"), peer("jax"), peer("torch_compile")]
    print(f"| {name} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |")
PY
echo "done at $((SECONDS-T0))s"
