"""The small prior a model-guided breadth collection carries to the GPU machine, and the
clean-up of what comes back (issue 22; data/fusion_h200_breadth2).

    python benchmarks/costmodel_breadth_prior.py prior DB
        keeps, per workload and board, the 4 fastest and 16 more (in the order of DuckDB's
        hash() of the candidate hash) ok measurements of DB and deletes the rest: a few MB
        that warm-start the model strategy and mark the measured workloads known, so that its
        breadth-first round visits the workloads no board measured first.
    python benchmarks/costmodel_breadth_prior.py strip DB RUN_ID [RUN_ID ...]
        deletes the runs given (the prior's) and what only they hold, leaving the collection.

DB is a tuning database (``tunedb db import`` of the exports); ``tunedb db export`` it after.
"""

from __future__ import annotations

import argparse

import duckdb

TABLES = ("devices", "runs", "workloads", "candidates", "measurements")


def keep_prior(con: duckdb.DuckDBPyConnection, fastest: int = 4, others: int = 16) -> None:
    con.execute("""
        CREATE TEMP TABLE keep AS
        SELECT candidate_hash, device_id, run_id FROM (
          SELECT m.candidate_hash, m.device_id, m.run_id,
            row_number() OVER (PARTITION BY c.workload_hash, m.device_id ORDER BY m.median_us) AS fast,
            row_number() OVER (PARTITION BY c.workload_hash, m.device_id
                               ORDER BY hash(m.candidate_hash)) AS other
          FROM measurements m JOIN candidates c ON c.hash = m.candidate_hash WHERE m.status = 'ok')
        WHERE fast <= ? OR other <= ?""", [fastest, others])
    con.execute("DELETE FROM measurements WHERE (candidate_hash, device_id, run_id) NOT IN "
                "(SELECT candidate_hash, device_id, run_id FROM keep)")
    con.execute("DELETE FROM candidates WHERE hash NOT IN (SELECT candidate_hash FROM measurements)")


def strip_runs(con: duckdb.DuckDBPyConnection, runs: list[str]) -> None:
    marks = ",".join("?" * len(runs))
    con.execute(f"DELETE FROM measurements WHERE run_id IN ({marks})", runs)
    con.execute(f"DELETE FROM runs WHERE id IN ({marks})", runs)
    con.execute("DELETE FROM candidates WHERE hash NOT IN (SELECT candidate_hash FROM measurements)")
    con.execute("DELETE FROM workloads WHERE hash NOT IN (SELECT workload_hash FROM candidates)")
    con.execute("DELETE FROM devices WHERE id NOT IN (SELECT device_id FROM measurements)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("prior", "strip"))
    ap.add_argument("db")
    ap.add_argument("runs", nargs="*", help="strip: the run ids to delete")
    args = ap.parse_args(argv)
    if args.action == "strip" and not args.runs:
        ap.error("strip needs the run ids to delete")
    con = duckdb.connect(args.db)
    try:
        keep_prior(con) if args.action == "prior" else strip_runs(con, args.runs)
        for t in TABLES:
            print(t, con.execute(f"SELECT count(*) FROM {t}").fetchone()[0])  # noqa: S608 (fixed names)
    finally:
        con.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
