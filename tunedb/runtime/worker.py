"""Crash-isolated task worker.

GPU work for candidates runs in a child process (multiprocessing *spawn* context, so no CUDA state is
ever inherited through fork). The parent sends a batch of items sharing one context (e.g. all
candidates of one workload) and receives one result per item, streamed in order. If the child dies
(illegal address, segfault, ``os._exit``) the item in flight gets ``runtime_error``; if it stops
answering for ``timeout_s`` it is killed and the item in flight gets ``timeout``. Either way the worker
is restarted and the rest of the batch goes on.

Messages are JSON over a pipe (no pickles cross the boundary after start-up). The task function is
named by ``"module:function"`` so it can be swapped, e.g. for a CPU-only fake in tests:

    task(state: dict, context: dict, items: list[dict]) -> Iterator[dict]

It yields exactly one result dict per item, in order. Special keys in a yielded dict:
``"_heartbeat": True`` (not a result; resets the parent's clock, e.g. after per-workload setup) and
``"_restart": True`` (the worker exits after sending it, e.g. after a sticky CUDA error). ``state`` is
a dict that lives as long as the worker process (module caches, the current workload's buffers).
An optional ``init(state) -> dict`` runs once at start; its dict is the worker's hello (device info).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from tunedb.runtime.device import CUPY_MISSING, NoGPUError
from tunedb.runtime.results import MeasureResult

TaskFn = Callable[[dict, dict, list], Iterator[dict]]


class WorkerError(RuntimeError):
    """The worker could not start (its init failed or it never answered)."""


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:2000] if text else type(exc).__name__


def task_spec(fn: str | Callable) -> str:
    """``"module:function"`` for a module-level function (or the string itself)."""
    if isinstance(fn, str):
        return fn
    name = getattr(fn, "__qualname__", "")
    if "." in name or "<" in name:
        raise ValueError(f"task {name!r} must be a module-level function")
    return f"{fn.__module__}:{name}"


def resolve(spec: str) -> Callable:
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ValueError(f"bad task spec {spec!r}; expected 'module:function'")
    return getattr(importlib.import_module(mod), attr)


def _send(conn: Any, obj: dict) -> None:
    conn.send_bytes(json.dumps(obj, allow_nan=True).encode())


def _worker_main(conn: Any, task: str, init: str | None) -> None:
    state: dict = {}
    try:
        fn = resolve(task)
        hello = resolve(init)(state) if init else {}
        _send(conn, {"kind": "hello", "info": hello})
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent as text
        _send(conn, {"kind": "fatal", "error": one_line(e)})
        return
    while True:
        try:
            msg = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if msg.get("op") == "stop":
            return
        try:
            for res in fn(state, msg.get("context", {}), msg.get("items", [])):
                if res.get("_heartbeat"):
                    _send(conn, {"kind": "ping"})
                    continue
                _send(conn, {"kind": "result", "result": res})
                if res.get("_restart"):
                    return
        except Exception as e:  # noqa: BLE001
            # The task's state may be half-built: report and exit; the parent restarts us.
            _send(conn, {"kind": "error", "error": one_line(e)})
            return
        _send(conn, {"kind": "done"})


def failure(status: str, error: str) -> dict:
    """The result of an item the process could not finish, in the wire form tasks yield."""
    return MeasureResult.failure(status, error).to_wire()


class Worker:
    """A restartable child process running ``task``; see the module docstring."""

    def __init__(self, task: str | Callable, init: str | Callable | None = None, timeout_s: float = 60.0,
                 setup_timeout_s: float | None = None, start_timeout_s: float = 180.0,
                 env: dict[str, str] | None = None) -> None:
        self.task = task_spec(task)
        self.init = task_spec(init) if init is not None else None
        self.timeout_s = float(timeout_s)
        # Per-context setup (inputs + float64 reference of a big workload) may take far longer
        # than one candidate; the task sends a heartbeat when it is done.
        self.setup_timeout_s = float(setup_timeout_s if setup_timeout_s is not None
                                     else max(300.0, self.timeout_s))
        self.start_timeout_s = float(start_timeout_s)
        self.env = dict(env or {})
        self.hello: dict = {}
        self.restarts = 0
        self._proc: Any = None
        self._conn: Any = None
        self._started = False

    # -- process management -------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def start(self) -> dict:
        """Start the child (if not running) and return its hello dict."""
        if self.alive:
            return self.hello
        self._reap()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)  # spawn copies the parent's environment at start
        try:
            proc = ctx.Process(target=_worker_main, args=(child, self.task, self.init), daemon=True)
            proc.start()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        self._proc, self._conn = proc, parent
        if not parent.poll(self.start_timeout_s):
            self._kill()
            raise WorkerError(f"worker did not start within {self.start_timeout_s:.0f}s")
        try:
            msg = json.loads(parent.recv_bytes())
        except (EOFError, OSError):
            code = proc.exitcode
            self._reap()
            raise WorkerError(f"worker died during start-up (exit code {code})") from None
        if msg.get("kind") != "hello":
            self._kill()
            raise WorkerError(msg.get("error", f"unexpected start-up message {msg.get('kind')!r}"))
        self.hello = msg.get("info") or {}
        self._started = True
        return self.hello

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
        self._reap()

    def _reap(self) -> None:
        if self._proc is not None:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        if self.alive:
            try:
                _send(self._conn, {"op": "stop"})
                self._proc.join(timeout=5)
            except (OSError, ValueError):
                pass
        self._kill()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- work ---------------------------------------------------------------------------------
    def run(self, context: dict, items: list) -> Iterator[tuple[int, dict]]:
        """Yield ``(index, result)`` for every item, in order. Failures of the process become
        results: ``runtime_error`` (died / raised) or ``timeout`` (hung), then a restart."""
        pending = list(range(len(items)))
        while pending:
            if not self.alive:
                if self._started:
                    self.restarts += 1
                self.start()
            sub = [items[i] for i in pending]
            try:
                _send(self._conn, {"op": "run", "context": context, "items": sub})
            except (OSError, ValueError) as e:
                self._kill()
                yield pending[0], failure("runtime_error", f"worker pipe broken: {one_line(e)}")
                pending = pending[1:]
                continue
            got = 0
            limit = self.setup_timeout_s
            deadline = time.monotonic() + limit
            while True:
                wait = max(0.0, deadline - time.monotonic())
                if not self._conn.poll(wait):
                    self._kill()
                    yield pending[got], failure("timeout", f"no result within {limit:.0f}s; worker killed")
                    pending = pending[got + 1:]
                    break
                try:
                    msg = json.loads(self._conn.recv_bytes())
                except (EOFError, OSError):
                    if self._proc is not None:
                        self._proc.join(timeout=10)
                    code = self._proc.exitcode if self._proc is not None else None
                    self._reap()
                    yield pending[got], failure(
                        "runtime_error", f"worker process died (exit code {code}) running this candidate")
                    pending = pending[got + 1:]
                    break
                kind = msg.get("kind")
                if kind == "ping":
                    limit = self.timeout_s
                    deadline = time.monotonic() + limit
                elif kind == "result":
                    res = msg.get("result") or {}
                    if got >= len(sub):
                        continue  # a task that yields too much: ignore the surplus
                    yield pending[got], res
                    got += 1
                    limit = self.timeout_s
                    deadline = time.monotonic() + limit
                    if res.get("_restart"):
                        self._reap()
                        pending = pending[got:]
                        break
                elif kind == "error":
                    self._reap()
                    if got < len(sub):
                        yield pending[got], failure("runtime_error", msg.get("error", "worker error"))
                        got += 1
                    pending = pending[got:]
                    break
                elif kind == "done":
                    for i in pending[got:]:
                        yield i, failure("runtime_error", "task produced no result for this item")
                    pending = []
                    break


def selftest_task(state: dict, context: dict, items: list) -> Iterator[dict]:
    """A CPU-only task for checking crash isolation anywhere: each item is
    ``{"action": "ok" | "exit" | "sleep" | "raise" | "restart", "value": x}``."""
    state["seen"] = state.get("seen", 0)
    yield {"_heartbeat": True}
    for item in items:
        state["seen"] += 1
        action = item.get("action", "ok")
        if action == "exit":
            os._exit(int(item.get("value", 3)))
        if action == "sleep":
            time.sleep(float(item.get("value", 3600)))
        if action == "raise":
            raise RuntimeError(str(item.get("value", "boom")))
        res = {"status": "ok", "value": item.get("value"), "pid": os.getpid(), "seen": state["seen"],
               "context": context.get("name")}
        if action == "restart":
            res["_restart"] = True
        yield res


def selftest_init(state: dict) -> dict:
    return {"pid": os.getpid()}


def start_gpu_worker(task: str, init: str, timeout_s: float) -> tuple[Worker, dict[str, Any]]:
    """A started worker process for a GPU device and its hello; no CuPy (checked before
    spawning anything) or no CUDA device in the worker is a ``NoGPUError``."""
    if importlib.util.find_spec("cupy") is None:
        raise NoGPUError(CUPY_MISSING)
    worker = Worker(task, init, timeout_s=timeout_s)
    try:
        return worker, worker.start()
    except WorkerError as e:
        msg = str(e)
        if "no CUDA device" in msg:
            raise NoGPUError(msg[msg.index("no CUDA device"):]) from None
        raise
