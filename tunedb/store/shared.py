"""A writer that holds the database file only while it writes, so that readers can watch.

DuckDB lets one process open a file read-write, and no process read it meanwhile. A collection
runs for hours; holding the file all along locks every ``db info``, ``plan`` and ``export`` out.
``SharedWriter`` keeps the TuningStore API but opens the file for each call (a batched commit,
a query) and closes it again once no call came for ``linger_s`` (calls in a burst, such as a
flush's workloads, candidates and measurements, share one open: a DuckDB open costs ~80 ms);
readers and this writer wait for each other with a busy timeout.
One writer per file still holds: the writer keeps an exclusive ``flock`` on the file (DuckDB's
own lock is a separate ``fcntl`` lock), so a second collector is refused at once.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tunedb.store.core import TuningStore
from tunedb.store.errors import StoreError


class SharedWriter:
    """``TuningStore``'s methods on a file opened per call; use as a context manager."""

    def __init__(self, path: str | Path, wait_s: float = 30.0,
                 on_wait: Callable[[str], None] | None = None, linger_s: float = 0.25) -> None:
        self._path = Path(path).expanduser()
        self._wait_s, self._on_wait, self._linger_s = wait_s, on_wait, linger_s
        self._store: TuningStore | None = None
        self._timer: threading.Timer | None = None
        self._mutex = threading.Lock()
        TuningStore.open(self._path, wait_s=wait_s, on_wait=on_wait).close()  # create, check, migrate
        self._fd: int | None = os.open(self._path, os.O_RDONLY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            self._fd = None
            raise StoreError(f"database {self._path} is being written by another tunedb process"
                             f"{_holder(self._path)}; tunedb allows one writer per file") from None
        # flock cannot say who holds it: the writer leaves its pid and host beside the file.
        try:
            _holder_file(self._path).write_text(f"{os.getpid()} {socket.gethostname()}\n")
        except OSError:
            pass  # a read-only folder: the refusal then names no holder

    def apply(self, func: Callable[..., Any], *args: Any) -> Any:
        """``func(store, *args)`` on the open file (for functions of ``tunedb.store.runs``)."""
        return self._call(func, args, {})

    def _call(self, name: str | Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        with self._mutex:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._store is None:
                self._store = TuningStore.open(self._path, wait_s=self._wait_s, on_wait=self._on_wait,
                                               known=True)
            try:
                if callable(name):
                    return name(self._store, *args, **kwargs)
                return getattr(self._store, name)(*args, **kwargs)
            finally:
                self._timer = threading.Timer(self._linger_s, self._release)
                self._timer.daemon = True
                self._timer.start()

    def _release(self) -> None:
        with self._mutex:
            if self._store is not None:
                self._store.close()
                self._store = None

    @property
    def path(self) -> Path:
        return self._path

    @property
    def read_only(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        method = getattr(TuningStore, name, None)
        if name.startswith("_") or not callable(method) or name in ("open", "transaction", "close"):
            raise AttributeError(f"SharedWriter has no {name!r} (it opens the file per call)")

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, args, kwargs)

        return call

    def close(self) -> None:
        with self._mutex:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self._release()
        if self._fd is not None:
            _holder_file(self._path).unlink(missing_ok=True)
            os.close(self._fd)  # releases the flock
            self._fd = None

    def __enter__(self) -> SharedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _holder_file(path: Path) -> Path:
    return path.with_name(path.name + ".writer")


def _holder(path: Path) -> str:
    """`` (pid N on HOST)`` from the holder's note, or nothing when there is none to read."""
    try:
        pid, _, host = _holder_file(path).read_text().strip().partition(" ")
    except OSError:
        return ""
    return f" (pid {pid} on {host})" if pid.isdigit() else ""
