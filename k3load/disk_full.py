"""The one line a run says when its evidence can no longer be written, and the free-space estimate before it.

    stopped_line(Path("runs/r1"), path, exc, records=1623, when=time.time())
    # 'disk full at runs/r1 (tmpfs at /mnt/r, 0 bytes free): load stopped at 21:05:14 after 1,623 records;
    #  the evidence up to there is intact: `k3load analyze runs/r1` once space is freed'
    space_needed(plan, interval_s, metrics_sources, gpu_sources)   # bytes a plan may write (docs/records.md)

Why one line naming the filesystem and what was kept: an operator whose disk filled needs three things
and no traceback: where (the directory and the filesystem under it, which may not be the one they think),
how much is there (the records up to the stop, all readable), and what to do (free space, then judge).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shlex
import time
from pathlib import Path

from k3load.workload.plan import Plan

FULL = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded"}

# Measured on `make demo` against the sim (docs/records.md, "Bytes per request"): the whole run directory
# (records, metrics, events, GPU samples, samples/, evidence/, reports) per request sent, and the figures a
# plan's estimate uses. Records dominate; a scrape line is per metrics source per sampling interval.
RECORD_BYTES = 242  # records.jsonl.gz, per record
SCRAPE_BYTES = 878  # metrics.jsonl.gz, per scrape of one source
GPU_ROW_BYTES = 450  # gpu.jsonl, per GPU per reading (plain JSON: an H200's row with DCGM extras is 430 B)
GPUS_PER_SOURCE = 8  # GPU readings are counted for a full node per source (an over-estimate off GPUs)
FIXED_BYTES = 4_000_000  # the rest: samples/, evidence/, compat.json, reports, manifest (a few MB)
REQUESTS_PER_USER_S = 1.0  # a user sends at most about one request a second against a real server


def space_needed(plan: Plan, interval_s: float, metrics_sources: int = 1, gpu_sources: int = 1) -> int:
    """Bytes the plan may write: its user-seconds at `REQUESTS_PER_USER_S` records, a scrape per metrics source
    and a node's GPU rows per GPU source each interval, and the fixed part."""
    requests = sum(stage.users * stage.duration_s for stage in plan.stages) * REQUESTS_PER_USER_S
    readings = plan.duration_s / interval_s if interval_s > 0 else 0
    per_reading = max(1, metrics_sources) * SCRAPE_BYTES + max(1, gpu_sources) * GPUS_PER_SOURCE * GPU_ROW_BYTES
    return int(requests * RECORD_BYTES + readings * per_reading + FIXED_BYTES)


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on `path`'s filesystem (None when it cannot be asked)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def size_text(n: int | None) -> str:
    if n is None:
        return "free space unknown"
    return f"{n:,} bytes" if n < 10**6 else f"{n / 10**6:,.1f} MB"


def mount_of(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) of `path` ("?" for a type /proc/self/mounts does not give)."""
    here = Path(os.path.abspath(path))
    while not here.exists() and here != here.parent:
        here = here.parent
    while not os.path.ismount(here) and here != here.parent:
        here = here.parent
    fstype = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and _unescape(fields[1]) == str(here):
                fstype = fields[2]  # the last mount at a point is the one seen
    return str(here), fstype


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_text(path: Path) -> str:
    """'tmpfs at /mnt/r, 0 bytes free'"""
    point, fstype = mount_of(path)
    free = free_bytes(Path(point))
    return f"{fstype} at {point}, {size_text(free)}{' free' if free is not None else ''}"


def failure_head(run_dir: Path, failed: Path, exc: OSError) -> str:
    """'disk full at runs/r1 (tmpfs at /mnt/r, 0 bytes free)', or for another error the file and the error."""
    full = FULL.get(exc.errno or 0)
    where = f"{full} at {run_dir}" if full else f"writing {failed} failed ({exc.strerror or exc})"
    return f"{where} ({filesystem_text(run_dir)})"


def stopped_line(run_dir: Path, failed: Path, exc: OSError, records: int, when: float) -> str:
    """The one line of a run stopped by a write that failed (see the module doc)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(when))
    then = "once space is freed" if exc.errno in FULL else "once the filesystem is writable again"
    kept = f"{records:,} record{'' if records == 1 else 's'}"
    return (f"{failure_head(run_dir, failed, exc)}: load stopped at {stamp} after {kept}; the evidence up to there "
            f"is intact: `k3load analyze {shlex.quote(str(run_dir))}` {then}")
