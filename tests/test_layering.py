"""The layer order of the design note, held by reading every module's imports with ``ast``.

Each layer imports only itself and the layers below it, at the top of a module and inside functions
alike (an import moved into a function still runs, it only runs later); no two modules import each
other at run time, directly or around a loop (an ``if TYPE_CHECKING:`` import never runs, so it
only has to respect the layers); a project module is imported inside a function only when it loads
a heavy optional package; no source file reaches 600 lines.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. Plugins (collectors/) sit with the engine they plug into.
LAYERS: tuple[str, ...] = ("graph", "kernels", "store", "runtime", "costmodel", "collect", "plan", "serve",
                           "bench", "report", "cli")
# bench and report are one level (neither is below the other); front ends that hand plans to other
# frameworks (tunedb.frontends) serve plans.
SAME_RANK = {"report": "bench", "frontends": "serve"}
# Modules outside a layer's package: the records every layer passes around sit at the bottom;
# the package itself (``tunedb.compile``) and ``python -m tunedb`` are the front door, at the top.
TOP_LEVEL = {"tunedb.records": "graph", "tunedb._version": "graph", "tunedb": "cli", "tunedb.__main__": "cli"}
MAX_LINES = 600
# Optional or slow-to-import packages: the only reason to import a project module inside a function
# is that it (or what it imports at its top) loads one of these.
HEAVY = frozenset({"cupy", "xgboost", "sklearn", "scipy", "torch", "jax", "onnx", "onnxruntime", "matplotlib",
                   "triton", "ml_dtypes", "rich", "typer", "dask", "distributed"})


def module_files() -> dict[str, Path]:
    """Every importable module of the project (``tunedb`` and the ``collectors`` plugins)."""
    out = {}
    for base in ("tunedb", "collectors"):
        for p in sorted((ROOT / base).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


MODULES = module_files()


def layer_of(module: str) -> str:
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    top, _, rest = module.partition(".")
    if top == "collectors":
        return "collect"
    sub = rest.split(".")[0]
    return sub


def rank(layer: str) -> int:
    """Position in LAYERS; an unknown layer (test_every_module_has_a_layer names it) ranks lowest."""
    layer = SAME_RANK.get(layer, layer)
    return LAYERS.index(layer) if layer in LAYERS else -1


def _target(name: str) -> str | None:
    """The project module an imported name lives in (the longest known prefix), if any."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


Import = tuple[str, int, bool, bool]  # (imported project module, line, inside a function, type-only)


def imports(module: str, path: Path) -> Iterator[Import]:
    """Every import of a project module in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def walk(node: ast.AST, in_function: bool, type_only: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            typing_only = type_only or _type_checking(child)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    t = _target(alias.name)
                    if t:
                        yield t, child.lineno, nested, typing_only
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                for alias in child.names:
                    full = f"{base}.{alias.name}"  # ``from package import module``
                    t = full if full in MODULES else _target(base)
                    if t:
                        yield t, child.lineno, nested, typing_only
            yield from walk(child, nested, typing_only)

    yield from walk(tree, False, False)


@functools.cache  # five tests read the same import graph: parse the tree once
def edges() -> list[tuple[str, str, int, bool, bool]]:
    return [(m, t, line, fn, typ) for m, p in MODULES.items() for t, line, fn, typ in imports(m, p) if t != m]


def test_every_module_has_a_layer() -> None:
    unknown = sorted(m for m in MODULES if rank(layer_of(m)) < 0)
    assert not unknown, f"modules outside the layer order (add them to LAYERS or TOP_LEVEL): {unknown}"


def test_layers_import_only_downwards() -> None:
    bad = []
    for m, t, line, fn, _ in edges():
        lm, lt = layer_of(m), layer_of(t)
        if rank(lt) > rank(lm):
            where = "in a function" if fn else "at top level"
            bad.append(f"{MODULES[m].relative_to(ROOT)}:{line} ({lm}) imports {t} ({lt}) {where}")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_library_does_not_import_its_plugins() -> None:
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}" for m, t, line, _, _ in edges()
           if m.startswith("tunedb") and t.startswith("collectors")]
    assert not bad, "plugins are loaded through the tunedb.collectors entry points:\n" + "\n".join(bad)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_find_cycles_finds_a_loop_and_only_loops() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, t, _, _, type_only in edges():
        if not type_only:
            graph[m].add(t)
    cycles = find_cycles(graph)
    assert not cycles, "modules that import each other (also through functions):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_no_source_file_reaches_600_lines() -> None:
    long = []
    for base in ("tunedb", "collectors", "tests", "benchmarks"):
        for p in sorted((ROOT / base).rglob("*.py")):
            n = len(p.read_text().splitlines())
            if n >= MAX_LINES:
                long.append(f"{p.relative_to(ROOT)}: {n} lines")
    assert not long, f"files of {MAX_LINES} lines or more:\n" + "\n".join(long)


def test_import_resolution_sees_relative_and_function_level_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import tunedb.records\nif TYPE_CHECKING:\n    from tunedb.store import core\n\n\n"
                   "def f():\n    from tunedb.graph import ir\n    from . import hashing\n"
                   "    from .ops import canonical_attrs\n")
    got = sorted(imports("tunedb.graph.m", src))
    assert got == [("tunedb.graph.hashing", 8, True, False), ("tunedb.graph.ir", 7, True, False),
                   ("tunedb.graph.ops", 9, True, False), ("tunedb.records", 1, False, False),
                   ("tunedb.store.core", 3, False, True)]


def _external_top_level(path: Path) -> set[str]:
    """Top-level packages a module imports outside functions (``if TYPE_CHECKING`` aside)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def heavy_modules() -> set[str]:
    """Project modules whose import loads a HEAVY package (through their top-level imports)."""
    top: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, t, _, fn, type_only in edges():
        if not fn and not type_only:
            top[m].add(t)
    for m in MODULES:  # importing a module runs its packages' __init__ first
        parts = m.split(".")
        top[m] |= {".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES}
    heavy = {m for m, p in MODULES.items() if _external_top_level(p) & HEAVY}
    changed = True
    while changed:
        changed = False
        for m, deps in top.items():
            if m not in heavy and deps & heavy:
                heavy.add(m)
                changed = True
    return heavy


def test_imports_inside_functions_only_defer_heavy_modules() -> None:
    """A project import inside a function must be worth deferring: the module it names loads a
    heavy optional package. The CLI and the package's front door defer everything (``tunedb --help``
    and ``import tunedb`` stay fast), so they are exempt."""
    heavy = heavy_modules()
    bad = sorted({f"{MODULES[m].relative_to(ROOT)}:{line} imports {t} inside a function"
                  for m, t, line, fn, _ in edges() if fn and t not in heavy and layer_of(m) != "cli"})
    assert not bad, ("move these to the top of the module (nothing heavy hides behind them):\n"
                     + "\n".join(bad))
