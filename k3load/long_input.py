"""Size the long-input scenarios' reference document from the server's own context length.

Why from the server: "long input" only means something relative to `max_model_len` (2,048 on the
CPU test server, up to 1,048,576 for K3), and token counts differ between tokenizers, so the document
is sized with the server's `/tokenize` when it has one (vLLM and the sim both do), else estimated.
The document is deterministic: the same server gives the same bytes every run.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from k3load.scenario import Scenario

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


def long_context_for(scenario: Scenario, max_model_len: int, count_tokens: Callable[[str], int]) -> str | None:
    """The reference document a long-input scenario carries on a server of this context length."""
    if not scenario.long_input:
        return None
    fixed = scenario.system_prompt + json.dumps(list(scenario.tools)) + json.dumps(list(scenario.context))
    budget = int(scenario.long_input["fill_fraction"] * max_model_len) - count_tokens(fixed)
    budget -= max((t.settings["max_tokens"] for t in scenario.turns), default=0) // 2
    return size_document(budget, count_tokens)


def estimate_tokens(chars_per_token: float = 3.5) -> Callable[[str], int]:
    return lambda text: int(len(text) / chars_per_token) + 1
