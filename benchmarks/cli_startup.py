"""CLI start-up: how long ``tunedb --help`` and ``tunedb --version`` take, best of N runs.

    python benchmarks/cli_startup.py [--runs 7] [--source DIR ...]

Each command runs as a fresh subprocess (``python -m tunedb ...``, plus the installed ``tunedb``
script when there is one), so the numbers include interpreter start-up and every import that
registering the commands pulls in. ``--source`` times another checkout of tunedb side by side
(for example ``git archive <commit> tunedb collectors | tar -x -C DIR``: the tree before a
change); each source runs with its own directory first on PYTHONPATH, so run this from an
environment where tunedb is not installed in editable mode (its import hook would win over
PYTHONPATH). Prints a table (best wall and best CPU seconds), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = (("--help",), ("--version",))


def best_of(argv: list[str], env: dict[str, str], runs: int) -> tuple[float, float]:
    """Best wall time and best CPU time (user + system of the child; steadier on a busy
    machine) of ``runs`` runs, each checked to succeed."""
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        r = subprocess.run(argv, capture_output=True, env=env)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.decode()[-300:]}")
    return min(walls), min(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="Runs per command; the best one counts.")
    ap.add_argument("--source", type=Path, action="append", default=[],
                    help="Another tunedb source tree to time (repeatable).")
    args = ap.parse_args()
    sources = [("this tree", ROOT)] + [(str(s), s.resolve()) for s in args.source]
    rows = []
    for label, src in sources:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
        launchers = [("python -m tunedb", [sys.executable, "-m", "tunedb"])]
        script = shutil.which("tunedb")
        if script and src == ROOT:
            launchers.append(("tunedb script", [script]))
        for how, base in launchers:
            for cmd in COMMANDS:
                wall, cpu = best_of(base + list(cmd), env, args.runs)
                rows.append({"source": label, "launcher": how, "command": " ".join(cmd),
                             "best_wall_s": round(wall, 3), "best_cpu_s": round(cpu, 3)})
    width = max(len(r["source"]) for r in rows)
    print(f"{'source':<{width}}  {'launcher':<16}  {'command':<9}  wall s  cpu s   (best of {args.runs})")
    for r in rows:
        print(f"{r['source']:<{width}}  {r['launcher']:<16}  {r['command']:<9}  {r['best_wall_s']:6.3f}  "
              f"{r['best_cpu_s']:6.3f}")
    print(json.dumps({"runs": args.runs, "python": sys.version.split()[0], "results": rows}))


if __name__ == "__main__":
    main()
