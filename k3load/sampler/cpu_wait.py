"""How long the load generator was ready to run and waited for a CPU, per wall second (Linux schedstat).

Why this beside the CPU meter (k3load.sampler.loop.CpuMeter): a load generator at 100% of a core is
saturated and says so, but one starved by its host (other tenants, a server warming up on the same two
cores) reads low CPU, because it is not running; it is waiting. Every latency it measures then holds
that wait, and a closed loop sends less: with six busy loops beside it on two cores, the same healthy
sim's load-stage TTFT p50 went from 15 to 67 ms between two runs, which `k3load diff` called a change
beyond noise. The kernel counts exactly that wait: the second field of /proc/self/schedstat is the nanoseconds the
process's main thread (the one running the users' greenlets) spent runnable on a run queue, not running
(Documentation/scheduler/sched-stats.rst, "/proc/<pid>/schedstat"; kept when the kernel has
CONFIG_SCHED_INFO, as Debian's and most distributions' have). Where it is absent or unreadable the
meter reads None: unknown, never 0.
"""

from __future__ import annotations

import time
from pathlib import Path

SCHEDSTAT = Path("/proc/self/schedstat")


def run_queue_ns(text: str) -> int | None:
    """The run-queue wait in ns from a schedstat line `<on-cpu ns> <waiting ns> <timeslices>`; None for
    anything else (an empty file, words, a negative or missing field)."""
    fields = text.split()
    if len(fields) != 3 or not all(f.isascii() and f.isdigit() for f in fields):
        return None
    return int(fields[1])


def read_run_queue_ns(path: Path = SCHEDSTAT) -> int | None:
    """This process's run-queue wait so far, None where the kernel does not say."""
    try:
        return run_queue_ns(path.read_text(errors="replace"))
    except OSError:
        return None


class CpuWaitMeter:
    """Share of wall time (%) the process waited for a CPU since the last reading, like CpuMeter's windows.

    100 means the main thread was runnable the whole window and never got a CPU. Measured on a two-core
    machine over the stages of a short run against the sim: 3.6-7.7% quiet, 28-52% with six busy loops beside.
    """

    MIN_WINDOW_S = 0.05  # as CpuMeter: a window this short means nothing; the next reading covers it

    def __init__(self, path: Path = SCHEDSTAT) -> None:
        self.path = path
        self._wall, self._waited = time.monotonic(), read_run_queue_ns(path)

    def read(self) -> float | None:
        """None when the kernel does not count it, or right after the last reading."""
        wall, waited = time.monotonic(), read_run_queue_ns(self.path)
        elapsed = wall - self._wall
        if elapsed < self.MIN_WINDOW_S:
            return None
        before, self._wall, self._waited = self._waited, wall, waited
        if waited is None or before is None or waited < before:
            return None
        return round(min((waited - before) / 1e9 / elapsed * 100, 100.0), 1)
