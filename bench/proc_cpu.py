"""CPU seconds of a whole process tree, read from /proc (no psutil): what a benchmarked client costs.

Why the tree: GuideLLM and AIPerf run their work in child processes (workers, ZMQ services), and
Locust `--processes` forks too; counting only the parent would flatter them. The total is, over every
live process whose ancestry reaches the root, user + system time plus the user + system time of its
children that already exited and were reaped (cutime + cstime), so a worker that ends inside the
measured interval moves its time to its parent's account instead of losing it. A process reparented
away from the tree (an orphan adopted by init) is lost: none of the clients measured here does that.
"""

from __future__ import annotations

import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, CPU ticks of the process and its reaped children) or None once it has gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name may hold spaces and parentheses
    # after the name: state ppid ... utime(12) stime(13) cutime(14) cstime(15), 0-based from `state`
    return int(fields[1]), sum(int(x) for x in fields[11:15])


def tree_cpu_s(root: int) -> float | None:
    """CPU seconds of `root` and every live descendant (reaped children included); None once the root
    has gone (its reaped children's time went with it)."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (got := _stat(int(entry))) is not None:
            table[int(entry)] = got
    if root not in table:
        return None
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += table[pid][1]
        todo.extend(children.get(pid, ()))
    return total / TICKS


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds of one process (and its reaped children); None once it has gone."""
    got = _stat(pid)
    return got[1] / TICKS if got is not None else None
