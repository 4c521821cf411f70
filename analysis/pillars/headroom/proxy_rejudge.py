"""A buffered stream's latency breaches judged again on the server's own histograms (buffering.py says why).

Where a proxy buffered the streams, the client timed the proxy's blocks: a stage's client-side latency breach is
kept (on the server's figure) where the server's histogram was over the limit too, dropped where it was within,
and said as not judged (`latency_unjudged`) where the histogram cannot tell or there is none (TTFA). The stage's
other breaches stay as they were, first; the ones kept on the server's figure follow, in SERVER_SIDE's order.
"""

from __future__ import annotations

from dataclasses import replace

from k3load.analysis.pillars.headroom.buffering import SERVER_SIDE, ServerLatency, latency_on_server
from k3load.analysis.pillars.headroom.stage_row import StageRow
from k3load.analysis.pillars.headroom.stages import QUEUED_S
from k3load.analysis.pillars.limit_rules import RuleId
from k3load.analysis.pillars.rules import Breach, breach
from k3load.analysis.run.timeline import MetricIndex
from k3load.outcomes import Signal


def _rejudged(breached: set[RuleId], stage: str, t0: float, t1: float, waiting_sustained_s: float | None,
              index: MetricIndex, limits: dict[str, dict[str, float]]
              ) -> tuple[list[ServerLatency], list[Breach], list[str]]:
    """(the breached SLOs as the server judged them, the breaches kept on its figure, the unjudged ones' texts)."""
    queued = (waiting_sustained_s or 0) >= QUEUED_S  # over the SLO while requests queued: it grows with the queue
    judged = [j for j in latency_on_server(t0, t1, index, limits) if j.rule_id in breached]
    over = [breach(j.rule_id, Signal.QUEUE_LATENCY if queued else Signal.LATENCY, None, None, j.text,
                   f"metrics.jsonl stage={stage}") for j in judged if j.status == "over"]
    return judged, over, [j.text for j in judged if j.status == "unjudged"]


def proxy_judged(row: StageRow, index: MetricIndex, limits: dict[str, dict[str, float]]) -> StageRow:
    """The row with its client-side latency breaches judged on the server's histograms (unchanged: none)."""
    breached = {p.id for p in row.problems if p.id in SERVER_SIDE}
    if not breached:
        return row
    judged, over, unjudged = _rejudged(breached, row.stage, row.start_ts, row.start_ts + row.duration_s,
                                       row.waiting_sustained_s, index, limits)
    return replace(row, problems=(*(p for p in row.problems if p.id not in breached), *over),
                   server_side_latency=tuple(judged), latency_unjudged=tuple(unjudged))

