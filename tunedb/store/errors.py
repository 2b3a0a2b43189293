"""The one error type the store raises; its message is always a single line."""

from __future__ import annotations


class StoreError(Exception):
    """A tuning-database operation failed; nothing was written. ``str(e)`` is one line."""

    def __init__(self, message: str) -> None:
        # Callers print this as `error: <message>`: keep it on one line whatever the cause was.
        super().__init__(" ".join(str(message).split()))


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's text (DuckDB errors carry multi-line context)."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__
