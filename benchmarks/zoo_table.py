"""The zoo results (``bench_zoo_plan.py``'s JSON) as the markdown table of docs/frontends.md.

    python benchmarks/zoo_table.py RESULT.json [RESULT2.json ...] [BACKEND.json]
    python benchmarks/zoo_table.py --status STATUS.json [--ort]    # the CPU status, 52 rows

One row per model, batch and dtype: tunedb's whole plan (µs, kernels), verified or not, each
peer's time, and tunedb's speedup over the best peer that ran. With ``bench_torch_backend.py``'s
JSON, a second table for the torch.compile backend.

``--status`` imports and plans (default cost model, as ``bench_zoo_plan.py --plan-only``) every
file of data/graphs/zoo on the CPU, one row per model x exporter x {fp32, 16-bit} (bf16, else
fp16; further fp16 files follow) with the kernels or the one-line error, the export's error
where PyTorch could not export. ``--ort`` also runs onnxruntime (CPU) on each fp32 file with the
benchmark's fan-in-scaled weights and inputs against the float64 reference, by tunedb's
tolerance (exp term included). Results go to STATUS.json as they come (a rerun skips the files
already there).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

PEERS = ("torch_eager", "torch_compile", "torch_compile_ro", "jax")


def _us(x: Any) -> str:
    return "—" if not x or not math.isfinite(x) else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _row_key(name: str) -> tuple[str, int, str]:
    m = re.match(r"(.+)_dynamo_(fp32|bf16)(?:_b(\d+))?$", name)
    if not m:
        return name, 1, ""
    return m.group(1), int(m.group(3) or 1), m.group(2)


def _verified(e: dict) -> str:
    v = e.get("verify") or {}
    ref, ort = (v.get("reference") or {}), (v.get("onnxruntime") or {})
    if ref.get("ok") is None:
        return "—"
    marks = ["ref " + ("ok" if ref["ok"] else "FAIL")]
    if not ref["ok"] and ref.get("rel_err") is not None:
        # next to the peers' errors on the same inputs: a wrong plan, or a model no one meets
        errs = sorted(r for p in (e.get("peers") or {}).values()
                      if (r := (p or {}).get("rel_err")) is not None)
        peers = f"; peers {_rel(errs[0])}-{_rel(errs[-1])}" if errs else ""
        marks[0] += f" (rel {_rel(ref['rel_err'])}{peers})"
    if ort.get("ok") is not None:
        marks.append("ORT " + ("ok" if ort["ok"] else "FAIL"))
    return ", ".join(marks)


def _rel(x: float) -> str:
    return f"{x:.2g}"


def geomean_line(result: dict) -> str:
    """tunedb's geometric-mean speedup over each peer and over the best peer of each row, on
    the rows whose plan was verified against the reference (a fast wrong plan is no speedup)."""
    ratios: dict[str, list[float]] = {p: [] for p in (*PEERS, "best")}
    for e in result.get("entries", []):
        t = (e.get("tunedb") or {}).get("us")
        if not t or not ((e.get("verify") or {}).get("reference") or {}).get("ok"):
            continue
        us = {p: ((e.get("peers") or {}).get(p) or {}).get("us") for p in PEERS}
        for p, u in us.items():
            if u:
                ratios[p].append(u / t)
        if any(us.values()):
            ratios["best"].append(min(u for u in us.values() if u) / t)
    n = len(ratios["best"])
    parts = [f"{p} {math.exp(sum(map(math.log, r)) / len(r)):.2f}x" for p, r in ratios.items() if r]
    return f"Geometric mean over the {n} verified rows: " + (", ".join(parts) if parts else "none")


def zoo_lines(result: dict) -> list[str]:
    lines = ["| model | batch | dtype | tunedb µs | kernels (op by op) | verified | torch eager | "
             "torch.compile | reduce-overhead | jax.jit | vs best peer |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = sorted(result.get("entries", []), key=lambda e: _row_key(e["name"]))
    for e in rows:
        model, batch, dtype = _row_key(e["name"])
        t = (e.get("tunedb") or {}).get("us")
        peers = e.get("peers") or {}
        us = {p: (peers.get(p) or {}).get("us") for p in PEERS}
        ran = [u for u in us.values() if u]
        best = min(ran) if ran else None
        plan = e.get("plan") or {}
        kern = f"{plan.get('kernels')} ({(e.get('graph') or {}).get('op_by_op')})" if plan else "—"
        if e.get("error") and not t:
            lines.append(f"| {model} | {batch} | {dtype} | {e['error'][:60]} | {kern} | — | "
                         + " | ".join(_us(us[p]) for p in PEERS) + " | — |")
            continue
        vs = f"{best / t:.2f}x" if t and best else "—"
        lines.append(f"| {model} | {batch} | {dtype} | **{_us(t)}** | {kern} | {_verified(e)} | "
                     + " | ".join(_us(us[p]) for p in PEERS) + f" | {vs} |")
    return lines


def backend_lines(result: dict) -> list[str]:
    lines = ["| model | dtype | FX graphs (as plans) | max rel. diff vs eager | equal | eager µs | "
             "backend µs | plans replayed µs | compile s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in result.get("cases", []):
        if c.get("error"):
            lines.append(f"| {c['model']} | {c['dtype']} | {c['error'][:80]} | | | | | | |")
            continue
        lines.append(f"| {c['model']} | {c['dtype']} | {c['fx_graphs']} ({c['planned']}) | "
                     f"{c['max_rel_err']:.1e} | {'yes' if c['equal_within_tolerance'] else 'no'} | "
                     f"{_us(c.get('eager_us'))} | {_us(c.get('backend_us'))} | "
                     f"{_us(c.get('plan_replay_us'))} | {c['compile_s']} |")
    return lines


ZOO = Path(__file__).resolve().parent.parent / "data" / "graphs" / "zoo"
EXPORTERS = ("torchscript", "dynamo")
ZOO_ORDER = ("bert_base", "distilbert", "gpt2", "llama_small", "t5_encoder", "vit", "clip_text",
             "clip_vision", "whisper_encoder", "resnet50", "mobilenet_v3", "efficientnet_b0",
             "convnext_tiny")  # issue 24's order


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:200]


def status_of(file: Path, ort_check: bool) -> dict:
    """Import and plan one zoo file on the CPU; with ``ort_check`` (fp32) onnxruntime against
    the float64 reference on the benchmark's weights and inputs."""
    import time

    from tunedb.bench.plan import INPUT_SEED, onnxruntime_outputs, weighted_model
    from tunedb.graph.onnx_import import import_onnx
    from tunedb.plan.driver import compile as compile_plan
    from tunedb.runtime.inputs import make_inputs
    from tunedb.runtime.tolerance import error_ratio, reference_and_exp_span, tolerance

    rec: dict[str, Any] = {"file": file.name}
    t0 = time.perf_counter()
    try:
        model = weighted_model(file)
        graph = import_onnx(model)
        rec["import"] = {"ok": True, "nodes": len(graph.nodes), "s": round(time.perf_counter() - t0, 1)}
    except Exception as e:  # noqa: BLE001 - a failing model is a result
        rec["import"] = {"ok": False, "error": _one_line(e)}
        return rec
    t0 = time.perf_counter()
    try:
        plan = compile_plan(graph)
        rec["plan"] = {"ok": True, "kernels": plan.kernels, "by_kind": plan.totals()["by_kind"],
                       "s": round(time.perf_counter() - t0, 1)}
    except Exception as e:  # noqa: BLE001
        rec["plan"] = {"ok": False, "error": _one_line(e)}
    if ort_check:
        try:
            dev, ref_in = make_inputs(graph, INPUT_SEED)
            refs, span = reference_and_exp_span(graph, ref_in)
            ort_out = onnxruntime_outputs(model, graph, dev)
            worst = max(error_ratio(ort_out[v], refs[v], tolerance(graph, graph.type_of(v).dtype, span))[0]
                        for v in graph.outputs)
            plain = max(error_ratio(ort_out[v], refs[v], tolerance(graph, graph.type_of(v).dtype))[0]
                        for v in graph.outputs)
            rec["ort"] = {"ok": worst <= 1.0, "ratio": worst, "ratio_without_exp_term": plain,
                          "exp_span": span}
        except Exception as e:  # noqa: BLE001
            rec["ort"] = {"ok": None, "error": _one_line(e)}
    return rec


def run_status(out: Path, ort_check: bool) -> dict:
    manifest = json.loads((ZOO / "manifest.json").read_text())
    result = json.loads(out.read_text()) if out.is_file() else {"files": {}}
    for m in manifest:
        if "error" in m or m["file"] in result["files"]:
            continue
        rec = status_of(ZOO / m["file"], ort_check and m["dtype"] == "float32")
        result["files"][m["file"]] = rec
        print(json.dumps(rec), flush=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    result["manifest"] = manifest
    return result


def _status_cell(m: dict | None, st: dict | None) -> tuple[str, str, str, str]:
    """(dtype, import, plan, ort) cells of one status row."""
    if m is None:
        return "—", "not exported", "", ""
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[m["dtype"]]
    if "error" in m:
        return short, f"export failed: {m['error'][:90]}", "", ""
    if st is None:
        return short, "not run", "", ""
    imp, plan, ort = st["import"], st.get("plan") or {}, st.get("ort") or {}
    if not imp["ok"]:
        return short, f"FAIL: {imp['error'][:90]}", "", ""
    plan_cell = f"ok, {plan['kernels']} kernels" if plan.get("ok") else f"FAIL: {plan.get('error', '')[:90]}"
    ort_cell = ("—" if not ort else f"ok ({ort['ratio']:.2f} of bound)" if ort.get("ok")
                else f"FAIL ({ort['ratio']:.2f} of bound)" if "ratio" in ort else ort["error"][:60])
    return short, f"ok, {imp['nodes']} nodes", plan_cell, ort_cell


def status_lines(result: dict) -> list[str]:
    manifest, files = result["manifest"], result["files"]
    models = sorted(dict.fromkeys(m["model"] for m in manifest),
                    key=lambda m: ZOO_ORDER.index(m) if m in ZOO_ORDER else len(ZOO_ORDER))
    lines = ["| model | exporter | dtype | import | plan (CPU) | onnxruntime vs reference |",
             "|---|---|---|---|---|---|"]
    extra = []
    for model in models:
        for exporter in EXPORTERS:
            mine = [m for m in manifest if m["model"] == model and m["exporter"] == exporter]
            for want in ("float32", "16"):
                cands = [m for m in mine if (m["dtype"] == "float32") == (want == "float32")]
                cands.sort(key=lambda m: ("error" in m, m["dtype"] != "bfloat16"))
                pick = cands[0] if cands else None
                extra += [m for m in cands[1:] if "error" not in m]
                cells = _status_cell(pick, files.get(pick["file"]) if pick else None)
                note = " (eager attention)" if pick and pick.get("attn_implementation") else ""
                lines.append(f"| {model} | {exporter}{note} | " + " | ".join(cells) + " |")
    for m in extra:
        cells = _status_cell(m, files.get(m["file"]))
        lines.append(f"| {m['model']} | {m['exporter']} (extra) | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--status" and len(args) > 1:
        for line in status_lines(run_status(Path(args[1]), "--ort" in args)):
            print(line)
        return 0
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    docs = [json.loads(Path(a).read_text()) for a in args]
    zoo = [d for d in docs if "entries" in d]
    merged = merge_results(zoo)
    for line in zoo_lines(merged):
        print(line)
    print()
    print(geomean_line(merged))
    for a, d in zip(args, docs):
        if "cases" in d:
            print()
            for line in backend_lines(d):
                print(line)
        elif "runs" in d:  # the hand-off benchmark's rounds have their own table
            print(f"{a}: a hand-off rounds result; its table: "
                  f"python benchmarks/bench_torch_backend.py --table {a}", file=sys.stderr)
        elif "entries" not in d:
            print(f"error: {a} is neither a zoo nor a backend benchmark result", file=sys.stderr)
            return 2
    return 0


def merge_results(results: list[dict]) -> dict:
    """Several ``bench_zoo_plan.py`` results (the parts of ``zoo_h200_fill.sh``) as one: by
    entry name, a later file's finished entry replacing an earlier one."""
    by_name: dict[str, dict] = {}
    for r in results:
        for e in r.get("entries", []):
            old = by_name.get(e["name"])
            if old is None or (e.get("tunedb") or {}).get("us") or not (old.get("tunedb") or {}).get("us"):
                by_name[e["name"]] = e
    return {"entries": list(by_name.values())}


if __name__ == "__main__":
    sys.exit(main())
