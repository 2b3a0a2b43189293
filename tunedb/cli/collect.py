"""``tunedb collect``: run a collector over a suite on a GPU (or a replay of stored data)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from tunedb.cli.common import DbOption, JsonOption, handle_errors, open_shared_writer, print_json, usage_error

# Kept in step with tunedb.kernels.suites.SUITES (a test checks): importing the suites for --help
# would load NumPy and the graph layer.
SUITE_NAMES = ("quick", "standard", "full", "anchors", "breadth", "generalization")


def _summary_line(s: Any, device_kind: str = "") -> str:
    by = ", ".join(f"{k} {v}" for k, v in sorted(s.statuses.items()) if k != "ok")
    parts = [f"measured {s.measured} candidates of {s.workloads} workloads in {s.elapsed_s:.1f}s "
             f"({s.rate:.1f}/s): ok {s.ok}, failed {s.failed}" + (f" ({by})" if by else ""),
             f"already measured {s.already}", f"pruned {s.pruned}"]
    if s.missing:
        what = "verified in emulation, not timed" if device_kind == "emu" else "not in replay data"
        parts.append(f"{what} {s.missing}")
    if s.stopped:
        parts.append(f"stopped by {s.stopped} limit")
    return "; ".join(parts)


def collect(
    suite: Annotated[str, typer.Option("--suite", help=f"Workload suite: {', '.join(SUITE_NAMES)} "
                                       "(`tunedb suites` lists them).")],
    collector: Annotated[str, typer.Option("--collector", help="Registered collector "
                                           "(`tunedb collectors` lists them).")] = "fusion",
    db: DbOption = None,
    budget: Annotated[int | None, typer.Option("--budget", min=1,
                                               help="Measure at most N candidates.")] = None,
    time_s: Annotated[float | None, typer.Option("--time", min=0.0, help="Stop after S seconds.")] = None,
    device: Annotated[str, typer.Option("--device", help="cuda, emu (verify in the CPU emulator: "
                                        "failures stored, nothing timed), or replay:PATH (Parquet "
                                        "export dir or database) to replay stored data.")] = "cuda",
    workers: Annotated[int | None, typer.Option("--workers", min=0, show_default=False,
                                                help="Parallel compile processes; default: CPU "
                                                     "cores - 2.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=1.0,
                                           help="Seconds before a hung candidate is killed.")] = 60.0,
    strategy: Annotated[str, typer.Option("--strategy", help="Order of measurement: exhaustive (suite "
                                          "order), random, roofline or model (cost-model guided, "
                                          "retrained as data arrives).")] = "exhaustive",
    rounds: Annotated[int | None, typer.Option("--rounds", min=1, help="Stop after N rounds (random, "
                                               "roofline, model: a round measures --per-round "
                                               "candidates of every workload).")] = None,
    per_round: Annotated[int, typer.Option("--per-round", min=1,
                                           help="Candidates per workload per round.")] = 8,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the random and model "
                                      "strategies.")] = 0,
    cluster: Annotated[str | None, typer.Option("--cluster", help="Measure on a Dask cluster: local "
                                                 "(one worker per GPU; --workers replay workers) or "
                                                 "tcp://HOST:PORT (a running scheduler). Exhaustive "
                                                 "order only.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Generate, verify and time candidates; store every measurement (resumable).

    The database is held only while a batch of results is committed, so `tunedb db info` and
    other readers work during a collection. Ctrl-C stops after the last commit; run the same
    command again to resume.

    Example: tunedb collect --suite quick --db h200.duckdb
    """
    from tunedb.collect import load_collector, make_strategy

    try:
        coll = load_collector(collector)
        strat = make_strategy(strategy, per_round=per_round, seed=seed)
    except ValueError as e:
        usage_error(str(e))
    if cluster is not None:
        _collect_on_cluster(coll, db, cluster, device, suite, budget, workers, strategy, json_out)
        return
    try:
        # stage candidates are plans: the planner lends its loader to the plugin below it
        lent: dict[str, Any] = {}
        if coll.kind == "stage":
            from tunedb.plan.stage_refine import harness_plan

            lent["load_plan"] = harness_plan
        dev = coll.open_device(device, workers=workers, timeout_s=timeout, **lent)
    except ValueError as e:
        usage_error(str(e))
    from tunedb.store.runs import close_abandoned_runs, drop_run_if_empty

    try:
        with open_shared_writer(db) as store:
            closed = store.apply(close_abandoned_runs)  # we hold the writer lock: those runs are dead
            if closed and not json_out:
                typer.echo(f"closed {closed} run(s) that a killed collection left open", err=True)
            if json_out:
                summary = coll.run(store, dev, suite, budget=budget, time_s=time_s, strategy=strat,
                                   rounds=rounds)
            else:
                summary = _run_with_progress(coll, store, dev, suite, budget, time_s, strat, rounds)
            if summary.measured == 0:
                store.apply(drop_run_if_empty, summary.run_id)  # a run row means something was measured
        stats = getattr(dev, "stats", dict)()  # where the device's time went (phases)
    finally:
        dev.close()
    if json_out:
        print_json({**summary.to_json(), "device_stats": stats})
    else:
        typer.echo(_summary_line(summary, getattr(dev, "kind", "")))
        if stats:
            typer.echo("device: " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in stats.items()))


def _collect_on_cluster(coll: Any, db: Any, cluster: str, device: str, suite: str, budget: int | None,
                        workers: int | None, strategy: str, json_out: bool) -> None:
    from tunedb.collect.dask_backend import collect_on_cluster
    from tunedb.store.runs import close_abandoned_runs

    if strategy != "exhaustive":
        usage_error(f"--cluster runs the exhaustive strategy only, not {strategy!r}")
    with open_shared_writer(db) as store:
        store.apply(close_abandoned_runs)  # we hold the writer lock: those runs are dead
        summary = collect_on_cluster(coll, store, cluster, device, suite, budget=budget,
                                     n_workers=workers, show_progress=not json_out)
    if json_out:
        print_json(summary.to_json())
    else:
        typer.echo(_summary_line(summary, device.partition(":")[0]))
        typer.echo("per worker: " + ", ".join(f"{w} {n}" for w, n in sorted(summary.workers.items())))


def _run_with_progress(coll: Any, store: Any, dev: Any, suite: str, budget: int | None,
                       time_s: float | None, strategy: Any = None, rounds: int | None = None) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]collect"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]:.1f}/s ok {task.fields[ok]} failed {task.fields[failed]}"),
                  TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("collect", total=None, rate=0.0, ok=0, failed=0)

        def progress(s: Any) -> None:
            todo = max(0, s.total - s.already)
            total = min(todo, budget) if budget is not None else todo
            bar.update(task, completed=s.measured + s.missing, total=total or None, rate=s.rate,
                       ok=s.ok, failed=s.failed)

        return coll.run(store, dev, suite, budget=budget, time_s=time_s, progress=progress,
                        strategy=strategy, rounds=rounds)


def register(app: typer.Typer) -> None:
    app.command("collect")(handle_errors(collect))


