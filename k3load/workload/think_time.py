"""The gaps real agents leave between turns: a tool's execution time, a user's reading and typing.

Why: closed-loop users with no think time keep one request in flight each, back to back, which no
agent does; in a stage whose sessions arrive open-loop (a plan stage's `arrival`) each session waits
before each turn as its agent would. The scenario declares each tool's time (`executors.NAME.time_s`)
and the user's (`user_think_s`), lognormal (a median and a spread, capped: service times are skewed
to the right); the defaults below stand where it declares none. A turn after a tool call waits for the
calls the scripted history says were made (parallel calls run together: the longest); a turn after an
answer waits for the user. The first turn waits for nothing (its session's arrival is its time).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from k3load.workload.scenario import Scenario


@dataclass(frozen=True)
class Duration:
    """A lognormal duration in seconds; sigma 0 is always the median."""

    median_s: float
    sigma: float = 0.5
    max_s: float = 60.0

    @classmethod
    def of(cls, spec: dict[str, Any] | None, default: Duration) -> Duration:
        if not spec:
            return default
        return cls(float(spec["median_s"]), float(spec.get("sigma", 0.5)), float(spec.get("max_s", 60.0)))

    def draw(self, rng: random.Random) -> float:
        value = self.median_s * math.exp(rng.gauss(0.0, self.sigma)) if self.sigma > 0 else self.median_s
        return min(max(value, 0.0), self.max_s)


DEFAULT_TOOL_TIME = Duration(1.0, 0.8, 30.0)
DEFAULT_USER_THINK = Duration(3.0, 0.6, 60.0)


def tool_time(scenario: Scenario, name: str) -> Duration:
    return Duration.of((scenario.executors.get(name) or {}).get("time_s"), DEFAULT_TOOL_TIME)


def called_tools(scenario: Scenario, turn_index: int) -> list[str]:
    """The tools the scripted history says the turn called (its `reply.tool_calls`)."""
    reply = scenario.turns[turn_index].reply or {}
    return [str(call.get("name")) for call in reply.get("tool_calls") or [] if call.get("name")]


def gap_before(scenario: Scenario, turn_index: int, rng: random.Random) -> float:
    """Seconds an agent waits before sending turn `turn_index` (0 for the first turn)."""
    if turn_index <= 0:
        return 0.0
    tools = called_tools(scenario, turn_index - 1)
    if tools:
        return max(tool_time(scenario, name).draw(rng) for name in tools)
    return Duration.of(scenario.user_think_s, DEFAULT_USER_THINK).draw(rng)
