#!/bin/bash
# Issue 23's GPU smoke test of collection on Dask, from the checkout's root on a GPU machine:
#  1. `tunedb collect --suite quick --cluster local` (dask-cuda's LocalCUDACluster: a worker per GPU);
#  2. two Dask workers sharing GPU 0 behind a scheduler (`--cluster tcp://...`, --budget 512),
#     started while step 1 runs;
#  3. with SCALE_BUDGET=N on a machine of several GPUs: N standard-suite candidates by the
#     one-process collector on GPU 0 (the peer), by `--cluster local` on GPU 0, then on every GPU.
# Databases, JSON summaries and logs go to $OUT; check the rows afterwards with
#   python benchmarks/scaleout.py smoke --suite quick --db $OUT/local.duckdb --db $OUT/two.duckdb
# WHEELS (optional): a folder of wheels to install first (dask, distributed, dask-cuda, duckdb, ...
# for a machine without them). LOCAL_S / TWO_S bound each step in seconds.
set -u
T0=$SECONDS
OUT=${OUT:-$(mktemp -d)}
PY=${PYBIN:-python3}
DEVICE=${DEVICE:-cuda}   # DEVICE=replay:PATH runs the same steps on a CPU
if [ -n "${WHEELS:-}" ]; then
  SITE=$(mktemp -d)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl || exit 3
  export PYTHONPATH=$SITE:$PWD
fi
export PYTHONUNBUFFERED=1
command -v nvidia-smi > /dev/null && nvidia-smi -L > "$OUT/gpus.txt" 2>&1
$PY -c "
import importlib.metadata as m
for p in ('dask', 'distributed', 'dask-cuda', 'duckdb'):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, 'not installed')"
$PY -m distributed.cli.dask_scheduler --host 127.0.0.1 --port 8786 --no-dashboard > "$OUT/scheduler.log" 2>&1 &
SCHED=$!
sleep 1
# A GPU device starts child processes: Dask's workers must not be daemonic.
DASK_DISTRIBUTED__WORKER__DAEMON=False $PY -m distributed.cli.dask_worker tcp://127.0.0.1:8786 --nworkers 2 \
  --nthreads 1 --no-dashboard > "$OUT/workers.log" 2>&1 &
WORKERS=$!
timeout "${LOCAL_S:-60}" $PY -m tunedb collect --suite quick --db "$OUT/local.duckdb" --device "$DEVICE" \
  --cluster local --workers 1 --json > "$OUT/local.json" 2> "$OUT/local.err"
echo "local rc=$? at $((SECONDS-T0))s"; head -c 900 "$OUT/local.json"; echo
timeout "${TWO_S:-30}" $PY -m tunedb collect --suite quick --db "$OUT/two.duckdb" --device "$DEVICE" \
  --cluster tcp://127.0.0.1:8786 --budget 512 --json > "$OUT/two.json" 2> "$OUT/two.err"
echo "two rc=$? at $((SECONDS-T0))s"; head -c 900 "$OUT/two.json"; echo
kill $WORKERS $SCHED 2>/dev/null
# 3. (SCALE_BUDGET=N, several GPUs) scaling: N standard-suite candidates by the one-process collector
#    on GPU 0, by a cluster on GPU 0 alone, then by a cluster on every GPU; rates between commits.
if [ -n "${SCALE_BUDGET:-}" ]; then
  for n in single one all; do
    if [ $n = all ]; then unset CUDA_VISIBLE_DEVICES; else export CUDA_VISIBLE_DEVICES=0; fi
    if [ $n = single ]; then how=(); else how=(--cluster local); fi
    timeout "${SCALE_S:-180}" $PY -m tunedb collect --suite standard --budget "$SCALE_BUDGET" \
      --device "$DEVICE" --db "$OUT/scale_$n.duckdb" "${how[@]}" --json > "$OUT/scale_$n.json" 2> "$OUT/scale_$n.err"
    echo "scale $n rc=$? at $((SECONDS-T0))s"
  done
  unset CUDA_VISIBLE_DEVICES
  $PY benchmarks/scaleout.py smoke --suite standard --db "$OUT/scale_single.duckdb" \
    --db "$OUT/scale_one.duckdb" --db "$OUT/scale_all.duckdb" --summary "$OUT/scale_all.json" \
    --json "$OUT/scaleout_scaling.json" | grep -E '"(measurements|duplicates|rate_between_commits_per_s)"'
fi
echo "done at $((SECONDS-T0))s"
