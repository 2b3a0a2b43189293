"""Collection: measure a suite's candidates on a device into the tuning store.

The engine (``engine.Collector``: resume, the single writer, pipelining) and the search strategies
(``strategy``) live here; the plugins that say what to measure (``collectors/fusion.py``, ...)
subclass ``Collector`` and register in the ``tunedb.collectors`` entry points.
"""

from __future__ import annotations

from tunedb.collect.engine import BUILTIN_COLLECTORS, Collector, git_sha, load_collector, now_iso
from tunedb.collect.jobs import CollectError, Job, Summary, Task
from tunedb.collect.strategy import STRATEGIES, Strategy, make_strategy

__all__ = ["BUILTIN_COLLECTORS", "STRATEGIES", "CollectError", "Collector", "Job", "Strategy", "Summary",
           "Task", "git_sha", "load_collector", "make_strategy", "now_iso"]
