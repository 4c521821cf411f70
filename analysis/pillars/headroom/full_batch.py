"""Requests waiting behind a full batch: the evidence that a load step is past what the server holds.

Why not the sustained-waiting limit: it is a stretch of time, and a step shorter than the limit never
breaches it, so a server that runs one request at a time while the others wait passed a 15 s step
with "max_concurrency 3" (issue 27). This reads the share of the step's scrapes in which requests
waited while the engine ran as many as it would: `vllm:num_requests_waiting` > 0 while
`vllm:num_requests_running` sat at the engine's cap. vLLM's scheduler admits waiting requests until
`max_num_seqs` run or the KV cache or the token budget is spent (v1/core/sched/scheduler.py), so a
waiting request beside a batch at its cap is queueing for the batch; the same gauges the sim serves
(k3load/sim/engine.py, running never above its max_num_seqs).

The cap: `max_num_seqs` where the server says it (the start-up log's "non-default args" line the
precheck saved); otherwise the most the engine ran at once in the step, but only where that stayed
below the step's users (the engine never ran all of them at once, so something capped it: the
batch, the KV cache or the token budget). With neither, nothing is marked: the cap is unknown and
requests waiting for one long CPU prefill step are no queue behind a full batch (analysis/run/timeline.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from k3load.analysis.run.timeline import MetricIndex
from k3load.precheck.startup_log import non_default_args
from k3load.sampler.vllm_metrics import VllmMetric

PAST_CAPACITY_SHARE = 0.5  # requests waited behind a full batch for most of the step
MIN_SCRAPES = 3  # fewer scrapes with both gauges: too few to say "most of the step"
RUNNING = VllmMetric.NUM_REQUESTS_RUNNING
WAITING = VllmMetric.NUM_REQUESTS_WAITING
_ARGS_LINE = re.compile(r"non-default args: (\{.*\})\s*$", re.MULTILINE)


@dataclass(frozen=True)
class EngineCap:
    """The most requests the engine runs at once, and where that was read."""

    max_num_seqs: int
    where: str


@dataclass(frozen=True)
class BatchQueue:
    """One step's scrapes: how many had both gauges, how many showed requests waiting behind a full batch."""

    scrapes: int
    queued: int
    cap: int | None
    cap_from: str  # "max_num_seqs (...)" | "the most it ran at once" | "" (unknown)

    @property
    def share(self) -> float | None:
        return self.queued / self.scrapes if self.scrapes else None

    @property
    def past_capacity(self) -> bool:
        return self.scrapes >= MIN_SCRAPES and self.queued / self.scrapes > PAST_CAPACITY_SHARE


def batch_queue(running: list[tuple[float, float]], waiting: list[tuple[float, float]], cap: EngineCap | None,
                users: int | None) -> BatchQueue:
    """One source's scrapes in the step (ts, value): the queue behind a full batch. The live search reads
    the same function over the scrapes it has so far."""
    run_at = dict(running)
    pairs = [(run_at[ts], value) for ts, value in waiting if ts in run_at]
    if cap is not None:
        limit: int | None = cap.max_num_seqs
        source = f"max_num_seqs {cap.max_num_seqs} ({cap.where})"
    else:
        most = max((r for r, _ in pairs), default=0.0)
        limit = int(most) if most >= 1 and users is not None and most < users else None
        source = "the most it ran at once in the step" if limit is not None else ""
    if limit is None:
        return BatchQueue(len(pairs), 0, None, "")
    queued = sum(1 for r, w in pairs if w > 0 and r >= limit)
    return BatchQueue(len(pairs), queued, limit, source)


def stage_batch_queue(index: MetricIndex, t0: float, t1: float, cap: EngineCap | None,
                      users: int | None) -> BatchQueue | None:
    """The worst source's reading over [t0, t1]; None when no source served both gauges there."""
    readings = [batch_queue(index.points(RUNNING, t0, t1, source=source),
                            index.points(WAITING, t0, t1, source=source), cap, users) for source in index.sources]
    readings = [r for r in readings if r.scrapes]
    if not readings:
        return None
    return max(readings, key=lambda r: (r.past_capacity, r.share or 0.0, r.scrapes))


def engine_cap(run_dir: Path) -> EngineCap | None:
    """`max_num_seqs` from the start-up logs the precheck saved (evidence/startup.log, one per node under
    evidence/startup/): the smallest where nodes differ. None where no log says it (vLLM's default then
    depends on its version and the device, so it is not guessed)."""
    evidence = run_dir / "evidence"
    found: list[EngineCap] = []
    for path in [evidence / "startup.log", *sorted((evidence / "startup").glob("*.log"))]:
        try:
            with path.open("rb") as handle:
                text = handle.read(1 << 20).decode(errors="replace")
        except OSError:
            continue
        match = _ARGS_LINE.search(text)
        value = non_default_args(match.group(1)).get("max_num_seqs") if match else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found.append(EngineCap(value, f"the start-up log's non-default args, {path.relative_to(run_dir)}"))
    return min(found, key=lambda c: c.max_num_seqs) if found else None
