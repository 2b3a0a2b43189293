"""Housekeeping of the ``runs`` table by the one writer of a file (``SharedWriter``'s holder).

A run row is written when a collection starts and finished when it ends (also on Ctrl-C). A
kill -9, or an interrupt before the collection got going, leaves it open; the next writer, which
holds the file's writer lock and so knows that no collection is alive, closes it. A collection
that measured nothing leaves no run row.
"""

from __future__ import annotations

from tunedb.store.core import TuningStore

# clocks_after of a run that a later writer closed: the process ended without finishing it.
ABANDONED = '{"closed_by": "next writer", "reason": "process ended without finishing the run"}'


def close_abandoned_runs(store: TuningStore) -> int:
    """Finish every open run (no ``finished_at``) at its last measurement; delete an open run
    that measured nothing. Returns how many runs were closed or deleted. Call only while holding
    the writer lock."""
    with store.transaction("close abandoned runs") as con:
        empty = con.execute(
            "DELETE FROM runs WHERE finished_at = '' AND NOT EXISTS "
            "(SELECT 1 FROM measurements m WHERE m.run_id = runs.id) RETURNING id").fetchall()
        closed = con.execute(
            "UPDATE runs SET finished_at = coalesce(("
            "  SELECT strftime(max(m.measured_at) AT TIME ZONE 'UTC', '%Y-%m-%dT%H:%M:%S+00:00')"
            "  FROM measurements m WHERE m.run_id = runs.id), runs.started_at), clocks_after = ? "
            "WHERE finished_at = '' RETURNING id", [ABANDONED]).fetchall()
    return len(empty) + len(closed)


def drop_run_if_empty(store: TuningStore, run_id: str) -> bool:
    """Delete run ``run_id`` if no measurement refers to it; True if it was deleted."""
    with store.transaction("drop an empty run") as con:
        rows = con.execute(
            "DELETE FROM runs WHERE id = ? AND NOT EXISTS "
            "(SELECT 1 FROM measurements m WHERE m.run_id = runs.id) RETURNING id", [run_id]).fetchall()
    return bool(rows)
