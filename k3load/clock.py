"""The one clock every timeline of a run is stamped with: epoch seconds from perf_counter, anchored to
time.time() once per process.

Why one clock, and not time.time() for some files: records, events and scrapes are joined on their
timestamps (a stage's scrapes, the control window's counters, a crash's requests in flight). A wall
clock that steps mid-run (an NTP step, a VM paused and resumed, a live migration) moved the events and
the sampler's scrapes while the records, on perf_counter, did not: seen here as a 28 s drift over two
minutes, so the load stage's requests seemed to start before its stage_start and the cache window
lost the last pairs' counters. Anchored once, the values still join with other machines' wall clocks
to within the anchor's accuracy, and intervals within the run stay exact.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

Clock = Callable[[], float]


@functools.cache
def wall_clock() -> Clock:
    """Epoch seconds from perf_counter, anchored to time.time() once per process."""
    offset = time.time() - time.perf_counter()
    perf_counter = time.perf_counter
    return lambda: perf_counter() + offset


def now() -> float:
    return wall_clock()()
