"""Size the long-input scenarios' reference document from the server's own context length.

Why from the server: "long input" only means something relative to `max_model_len` (2,048 on the
CPU test server, up to 1,048,576 for K3), and token counts differ between tokenizers, so the document
is sized with the server's `/tokenize` when it has one (vLLM and the sim both do), else estimated.
The document is deterministic: the same server gives the same bytes every run. A scenario whose fixed
part and answer budget alone exceed the server's context cannot be played there at all: every request
would be refused with vLLM's context-length 400, which says nothing about the deployment, so the
harness says so once and sends none (`fit_long_input`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace

from k3load.workload.scenario import Scenario

_SECTIONS = ("Refund policy", "Shipping zones", "Escalation matrix", "Data retention", "Tone of voice",
             "Warranty terms", "Fraud signals", "Loyalty programme")


def paragraph(i: int) -> str:
    title = _SECTIONS[i % len(_SECTIONS)]
    return (f"## {title} ({i + 1})\nClause {i + 1}.1: apply the {title.lower()} rules to orders placed after "
            f"day {i * 3 + 1}; clause {i + 1}.2: record the decision with reference K3-{i:04d} and notify the "
            f"owning team within {i % 5 + 1} working days.")


def document(paragraphs: int) -> str:
    return "\n\n".join(paragraph(i) for i in range(paragraphs))


def size_document(target_tokens: int, count_tokens: Callable[[str], int]) -> str:
    """The longest document of whole paragraphs within `target_tokens` (bisection: log2 n counts)."""
    if target_tokens <= 0:
        return ""
    high = 1
    while count_tokens(document(high)) < target_tokens:
        high *= 2
    low = 0  # document(low) fits, document(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        if count_tokens(document(middle)) <= target_tokens:
            low = middle
        else:
            high = middle
    return document(low)


@dataclass(frozen=True)
class LongInputFit:
    """How a long-input scenario fits a server's context: the document to carry, or why none can."""

    scenario: str
    fixed_tokens: int  # system prompt + tools + fixed context, as counted by the server (or estimated)
    max_tokens: int  # the largest answer budget of its turns
    max_model_len: int
    document: str

    @property
    def fits(self) -> bool:
        """False: even without a document every request overflows the context (a certain 400)."""
        return self.fixed_tokens + self.max_tokens <= self.max_model_len


def fit_long_input(scenario: Scenario, max_model_len: int, count_tokens: Callable[[str], int]) -> LongInputFit:
    """The document a long-input scenario carries on a server of this context length (empty when the
    scenario does not fit, or leaves no room for one)."""
    if not scenario.long_input:
        raise ValueError(f"{scenario.name} has no long_input: only long-input scenarios are sized")
    fixed = count_tokens(scenario.system_prompt + json.dumps(list(scenario.tools)) + json.dumps(list(scenario.context)))
    max_tokens = max((t.settings["max_tokens"] for t in scenario.turns), default=0)
    budget = int(scenario.long_input["fill_fraction"] * max_model_len) - fixed - max_tokens // 2
    fit = LongInputFit(scenario.name, fixed, max_tokens, max_model_len, "")
    return replace(fit, document=size_document(budget, count_tokens)) if fit.fits else fit


def long_context_for(scenario: Scenario, max_model_len: int, count_tokens: Callable[[str], int]) -> str | None:
    """The reference document a long-input scenario carries on a server of this context length."""
    if not scenario.long_input:
        return None
    return fit_long_input(scenario, max_model_len, count_tokens).document


def estimate_tokens(chars_per_token: float = 3.5) -> Callable[[str], int]:
    return lambda text: int(len(text) / chars_per_token) + 1
