"""One digest of every generated kernel source of some suites: a check that a refactor of the
generators (or of the analysis under them) changed no kernel byte. Every case of each suite,
every schedule ``generable_schedules`` gives (the legal space plus the streaming twins), one
line each: suite, case, schedule, the plan's source hash and its kernels' names and launch
shapes (an ``UnsupportedFusion`` or generator error is a line too). Run it on the commit
before and the commit after; the digests must be equal (``--out`` writes the lines to diff).

    python benchmarks/kernel_source_digest.py [--suites quick,anchors] [--out FILE]

quick + anchors: about 6,300 schedules in seconds; standard,breadth,generalization: about
264,000 in a few minutes (the generalization suite reads data/graphs/generalization).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

from tunedb.kernels.codegen import generate
from tunedb.kernels.suites import SUITES, suite
from tunedb.runtime.emu import generable_schedules


def digest_lines(suites: list[str]) -> Iterator[str]:
    """One line per (suite, case, schedule), in suite order."""
    for name in suites:
        for case in suite(name):
            try:
                schedules = generable_schedules(case.graph)
            except Exception as e:  # noqa: BLE001 (the refusal is part of what must not change)
                yield f"{name} {case.name} unsupported {type(e).__name__}: {e}"
                continue
            for s in schedules:
                try:
                    p = generate(case.graph, s)
                    what = f"{p.source_hash} {[(k.name, k.grid, k.block) for k in p.kernels]!r}"
                except Exception as e:  # noqa: BLE001
                    what = f"error {type(e).__name__}: {e}"
                yield f"{name} {case.name} {s!r} {what}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suites", default="quick,anchors", help="comma-separated suite names")
    ap.add_argument("--out", type=Path, help="also write the lines here")
    args = ap.parse_args(argv)
    suites = [s for s in args.suites.split(",") if s]
    unknown = [s for s in suites if s not in SUITES]
    if unknown or not suites:
        print(f"error: unknown suite(s) {unknown or args.suites!r}; known: {', '.join(SUITES)}",
              file=sys.stderr)
        return 2
    lines = list(digest_lines(suites))
    text = "\n".join(lines)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(f"{len(lines)} lines  sha256 {hashlib.sha256(text.encode()).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
