# Sourced by the one-call GPU scripts: where results go ($OUT), which Python ($PYBIN), the tree on
# PYTHONPATH, unbuffered logs, the commit recorded in every JSON (a lent machine's copy of the tree
# may carry a stale .git, so TUNEDB_GIT_COMMIT wins), and the board's name in $OUT/gpus.txt.
OUT=${OUT:-$(mktemp -d)}
PY=${PYBIN:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TUNEDB_GIT_COMMIT=${TUNEDB_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
command -v nvidia-smi > /dev/null && nvidia-smi -L > "$OUT/gpus.txt" 2>&1
