"""Down spells of `/health`, told apart: a server that went away, or a health check that flapped.

Why: a load balancer's flapping health check (or a `/health` behind a tired gateway) says "down"
while the engine keeps answering. Counting that as a crash sends the operator to buy GPUs. A spell
is a flap when requests were answered in full while it lasted, none was cut around it (a crash cuts
the streams in flight) and no OOM / engine-dead log line came with it; the evidence is the records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3load.analysis.run.rundata import RunData
from k3load.events import Event

LOG_CRASH_EVENTS = (Event.LOG_OOM, Event.LOG_ENGINE_DEAD)
LOG_NEAR_S = 30.0
CUT_STATUSES = ("truncated", "stream_error", "transport_error")
DETECTION_S = 5.0  # a down is seen up to a few polls after the process died


@dataclass(frozen=True)
class DownSpell:
    down_ts: float
    up_ts: float | None  # None: never came back within the run
    served_during: int  # requests answered in full while /health said down
    cut: int  # requests cut (stream or connection broken) from shortly before the down to its end
    log_lines: int  # OOM / engine-dead lines within LOG_NEAR_S of the down

    @property
    def flap(self) -> bool:
        return self.served_during > 0 and not self.cut and not self.log_lines

    def to_dict(self) -> dict[str, Any]:
        return {"down_ts": self.down_ts, "up_ts": self.up_ts, "served_during": self.served_during,
                "cut": self.cut, "flap": self.flap}


def down_spells(data: RunData) -> list[DownSpell]:
    downs = sorted(e["ts"] for e in data.events_named(Event.SERVER_DOWN))
    ups = sorted(e["ts"] for e in data.events_named(Event.SERVER_UP))
    logs = [e["ts"] for e in data.events_named(*LOG_CRASH_EVENTS)]
    rows = data.columns.rows()
    ended = rows.number("end_ts") if downs else None
    ok = rows.code_is("status", "ok") if downs else None
    cut_short = rows.code_is("status", *CUT_STATUSES) if downs else None
    spells = []
    for down in downs:
        up = next((u for u in ups if u > down), None)
        end = up if up is not None else float("inf")
        assert ended is not None and ok is not None and cut_short is not None
        inside = (ended > down) & (ended < end)
        served = int((inside & ok).sum())
        around = (ended >= down - DETECTION_S) & (ended < end)
        cut = int((around & cut_short).sum())
        near = sum(1 for ts in logs if abs(ts - down) <= LOG_NEAR_S)
        spells.append(DownSpell(down, up, served, cut, near))
    return spells
