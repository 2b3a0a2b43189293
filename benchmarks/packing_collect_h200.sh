#!/usr/bin/env bash
# One H200 call (under 9 minutes): the packing `standard` suite (374 workloads, 4,064 candidates)
# collected on top of the shipped rows of data/packing_h200, exported for the repository.
#
#   bash benchmarks/packing_collect_h200.sh OUT_DIR [COMMIT]
#
# from the repository root on the GPU machine (CuPy and the CUDA runtime there; tunedb from the
# tree). The shipped rows go in first, so a board that measured before resumes (measures nothing
# twice) and a new board measures the whole suite (14.5 candidates/s on the last call: about
# 280 s). --time 420 stops the collection in time either way; whatever was measured is committed.
# Afterwards, on any machine: copy OUT_DIR/packing_h200 over data/packing_h200 and run
#   tunedb db import data/packing_h200 --db pk.duckdb
#   tunedb train --kind packing --db pk.duckdb --out models --json
set -u
out=${1:?usage: packing_collect_h200.sh OUT_DIR [COMMIT]}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ -n "${2:-}" ] && export TUNEDB_GIT_COMMIT=$2
db=$(mktemp -d)/packing.duckdb
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv > "$out/gpu.txt" 2>&1
python3 -m tunedb db import data/packing_h200 --db "$db" > "$out/import.log" 2>&1 || { cat "$out/import.log"; exit 1; }
timeout 480 python3 -m tunedb collect --collector packing --suite standard --db "$db" --time 420 \
  > "$out/collect.log" 2>&1
echo "collect rc=$?"; tail -15 "$out/collect.log"
python3 -m tunedb db export "$out/packing_h200" --db "$db" > "$out/export.log" 2>&1 || { cat "$out/export.log"; exit 1; }
python3 -m tunedb db info --db "$db" 2>&1 | tail -12
