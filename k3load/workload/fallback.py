"""A turn's `fallback:`: the request settings its one last attempt is sent with once its retries are exhausted.

Why its own module: the scenario parser (k3load/workload/scenario.py) builds it from the YAML and the retry policy
(k3load/workload/retry_policy.py) applies it to a turn; declared in either, the two imported each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Fallback:
    """A turn's `fallback:`: the request settings its one last attempt is sent with once its retries are
    exhausted (the last retry failed in a way `retry.when` retries). Each field left None (False) keeps the
    turn's own: `max_tokens` replaces the budget, `tool_choice` the choice, `drop_response_format` sends no
    `response_format`, `model` names another served model."""

    max_tokens: int | None = None
    tool_choice: str | dict[str, Any] | None = None
    drop_response_format: bool = False
    model: str | None = None

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Fallback:
        """From the scenario's `fallback:` mapping, already checked against the schema."""
        return cls(max_tokens=data.get("max_tokens"), tool_choice=data.get("tool_choice"),
                   drop_response_format="response_format" in data, model=data.get("model"))

    def body_keys(self) -> dict[str, Any]:
        """The body keys the fallback sets, with their values (a dropped key is not among them)."""
        keys = {"model": self.model, "max_tokens": self.max_tokens, "tool_choice": self.tool_choice}
        return {k: v for k, v in keys.items() if v is not None}
