#!/bin/bash
# Issue 21 on one H200, sized for one 9-minute device call, from the checkout's root: every
# bandwidth-tier workload of the generalization suite (153, windowed ones too) as a plan
# (tunedb.compile with the default model), verified against the float64 reference first, then
# timed next to torch eager, torch.compile and JAX in the same process (TIER_WORKERS worker
# processes compile at once, every timing holds the GPU alone). The JSON is rewritten after
# every workload; LIMIT_S stops the run with what finished recorded. A second call with
# RESUME=$PREVIOUS/generalization_tier.json runs only what the first did not finish; ONLY="NAME ..."
# runs only those workloads (docs/generalization-h200.md lists the ones the window and row-split
# changes after bcaadf4 touch: LIMIT_S=60 covers them).
# Results go to $OUT: generalization_tier.json, bench.log, gpus.txt; the table is printed.
set -u
T0=$SECONDS
. "$(dirname "$0")/gpu_call_env.sh"
LIMIT_S=${LIMIT_S:-470}
RESUME_ARGS=()
[ -n "${RESUME:-}" ] && RESUME_ARGS=(--resume "$RESUME")
# ONLY="name name ...": just these tier workloads (a re-measure of what a change touched)
[ -n "${ONLY:-}" ] && RESUME_ARGS+=(--only $ONLY)
timeout $((LIMIT_S + 40)) $PY benchmarks/bench_generalization.py "$OUT" --tier bandwidth \
  --workers "${TIER_WORKERS:-14}" --limit "$LIMIT_S" "${RESUME_ARGS[@]}" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at $((SECONDS-T0))s"
grep -E "^copy|^done|time limit" "$OUT/bench.log" | tail -n 5
$PY benchmarks/bench_generalization.py "$OUT" --table | tail -n 40
echo "done at $((SECONDS-T0))s"
