"""Where a bench result came from: the command line that ran it and the git commit of the code.

Every bench writer adds these to its JSON so that data/README.md can name the command and the
commit of each shipped file without guessing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def git_commit(where: Path | None = None) -> str | None:
    """``$TUNEDB_GIT_COMMIT`` when set: a copy of the tree shipped to a lent GPU machine names its
    commit there, since the copy may carry no ``.git`` or a stale one. Otherwise the commit checked
    out at ``where`` (default: this source tree), with ``-dirty`` appended when tracked files differ
    from it; None outside a checkout (an installed wheel) or without git."""
    named = os.environ.get("TUNEDB_GIT_COMMIT", "").strip() or None
    if named:
        return named
    cwd = where or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5, cwd=cwd, check=False)
        if head.returncode != 0 or not head.stdout.strip():
            return named
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, cwd=cwd, check=False)
    except (OSError, subprocess.SubprocessError):
        return named
    commit = head.stdout.strip()
    return commit + "-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else commit


def portable_argv(argv: Sequence[str], cwd: Path | None = None) -> list[str]:
    """The command line as someone else could type it: ``python -m tunedb`` as ``tunedb``, and
    absolute paths relative to the working folder (or by their file name when outside it), so a
    shipped result names no folder of the machine that ran it."""
    here = (cwd or Path.cwd()).resolve()
    out = []
    for i, arg in enumerate(argv):
        path = Path(arg)
        if i == 0 and path.name == "__main__.py":
            out.append(path.parent.name)
        elif path.is_absolute():
            try:
                out.append(str(path.resolve().relative_to(here)))
            except ValueError:
                out.append(path.name)
        else:
            out.append(arg)
    return out


def provenance(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``{"argv": ..., "git_commit": ...}`` for a result file; ``argv`` defaults to ``sys.argv``
    (pass the arguments a ``main(argv)`` was called with when they are not the process's)."""
    return {"argv": portable_argv(sys.argv if argv is None else argv), "git_commit": git_commit()}
