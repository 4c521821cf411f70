"""The load generator's wait for a CPU (k3load.sampler.cpu_wait): the kernel's schedstat line, read as outside
bytes (fuzzed), the meter's windows over a file whose counter the test moves, and the real /proc/self/schedstat
of a process kept busier than its CPUs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3load.loadgen.cpu import plain_percent
from k3load.sampler.cpu_wait import CpuWaitMeter, read_run_queue_ns, run_queue_ns


@given(st.text(max_size=60))
def test_any_text_is_a_wait_or_unknown_never_an_error(text):
    value = run_queue_ns(text)
    assert value is None or (isinstance(value, int) and value >= 0)


@given(st.integers(0, 2**63), st.integers(0, 2**63), st.integers(0, 2**40), st.sampled_from(["", "\n", " \n"]))
def test_a_schedstat_line_gives_its_second_field(on_cpu, waited, slices, end):
    assert run_queue_ns(f"{on_cpu} {waited} {slices}{end}") == waited


@pytest.mark.parametrize("text", ["", "1 2", "1 2 3 4", "1 -2 3", "a b c", "1 2.5 3", "١ ٢ ٣"])
def test_what_is_no_schedstat_line_is_unknown(text):
    assert run_queue_ns(text) is None


def test_the_meter_reads_the_share_of_its_window_spent_waiting(tmp_path: Path):
    stat = tmp_path / "schedstat"
    stat.write_text("5 1000 3\n")
    meter = CpuWaitMeter(stat)
    time.sleep(0.1)
    stat.write_text(f"5 {1000 + 40_000_000} 4\n")  # 40 ms waited within a window of at least 100 ms
    value = meter.read()
    assert value is not None and 0 < value <= 40.0 + 1e-9
    assert meter.read() is None  # right after a reading: too short a window, covered by the next
    time.sleep(0.06)
    stat.write_text("5 10 4\n")  # went backwards (another process's file, a reset): unknown, never negative
    assert meter.read() is None
    time.sleep(0.06)
    stat.write_text(f"5 {10 + 10**12} 4\n")  # more waited than the window lasted: capped at the whole window
    assert meter.read() == 100.0
    stat.unlink()
    time.sleep(0.06)
    assert meter.read() is None and read_run_queue_ns(stat) is None


@pytest.mark.skipif(read_run_queue_ns() is None, reason="this kernel does not count run-queue time")
def test_a_process_with_more_busy_threads_than_cpus_waits_for_one():
    """More busy processes than CPUs, this one busy too: the kernel counted its run-queue wait, so the meter
    reads a share above zero; never above the window."""
    cpus = len(os.sched_getaffinity(0))
    busy = [os.fork() for _ in range(cpus * 2)]
    for pid in busy:
        if pid == 0:  # a child: spin, then leave without running the parent's cleanup
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                pass
            os._exit(0)
    try:
        meter = CpuWaitMeter()
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            pass
        value = meter.read()
    finally:
        for pid in busy:
            os.waitpid(pid, 0)
    assert value is not None and 0 < value <= 100


@given(st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.floats(allow_nan=True), st.integers(-10**6, 10**6),
                 st.lists(st.integers(), max_size=2)))
def test_a_workers_wait_is_a_percentage_or_unknown(value):
    """A worker's message is outside bytes: only a number in [0, 100] is kept."""
    kept = plain_percent(value)
    assert kept is None or (isinstance(kept, float) and 0.0 <= kept <= 100.0 and kept == value)
