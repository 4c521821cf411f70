"""A process's memory from /proc, for the benches that watch one (bench/harness_soak.py, bench/analysis_scale.py).

Why one place: both read the same files; RSS counts pages a forked child shares with its parent in each of them,
so a process tree is summed by PSS (each shared page split between its holders), where the kernel gives it.
"""

from __future__ import annotations

from pathlib import Path


def _field_kib(path: Path, field: str) -> int | None:
    for line in path.read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return None


def rss_mib(pid: int) -> float | None:
    """Resident memory of one process (None once it has gone)."""
    try:
        found = _field_kib(Path(f"/proc/{pid}/status"), "VmRSS:")
    except (OSError, ValueError):
        return None
    return None if found is None else found / 1024


def tree_pss_mib(pid: int) -> float:
    """The proportional set size of a process and every descendant (RSS where a kernel gives no PSS); 0 for
    processes already gone."""
    total, pending = 0.0, [pid]
    while pending:
        current = pending.pop()
        try:
            try:
                found = _field_kib(Path(f"/proc/{current}/smaps_rollup"), "Pss:")
            except OSError:
                found = _field_kib(Path(f"/proc/{current}/status"), "VmRSS:")
            total += (found or 0) / 1024
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total
