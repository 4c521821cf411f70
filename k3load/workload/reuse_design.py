"""Designed prefix reuse, measured at run start with the server's own tokenizer: `reuse_design.json`.

Why measure it and not assume it: the samples are built to share (or not share) a prefix, but what a
prefix cache can reuse is decided in tokens, after the server's chat template has rendered the request.
Kimi's template renders the tool declarations before the system prompt, so a salt that opens the
system prompt still leaves every "cold" request sharing the whole tool head (issue 15: 23% reuse in a
family meant to be cold). Only the server's tokenizer (`POST /tokenize` with `messages` and `tools`, the
template applied, as vLLM 0.32's TokenizeChatRequest and the sim both accept) says where two requests
part.

What is measured: every turn of every scenario the run plays, built exactly as its users build it
(`k3load.workload.stored_requests.build_request`) with the salt they would use: variant `A`, and for the salted kinds
(`request`, `pair`) a second variant `B` with another salt, standing for a different request or user.
The file holds the prompt length of each variant and the matrix of their shared token prefixes; the
analysis (`k3load.analysis.pillars.cache.reuse`) replays the run's send order over it. Designed reuse of a request =
the longest token prefix it shares with any request whose prefill finished before it was sent, capped
at its prompt length minus one and floored to whole cache blocks: what a perfect prefix cache (no
eviction) reuses given the order the requests were sent; partial blocks are never reused. The block size
comes from vllm:cache_config_info at analysis time, so nothing here needs it.

Why at run start, in a greenlet: the analysis must not need the server, and the measurement must never
delay the load. When /tokenize is missing or refuses (some gateways) the file says why instead, and the
analysis says "inconclusive, because the server's tokenizer was not reachable (...)".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import httpx

from k3load.client.origin import redirect_note
from k3load.workload.scenario import Scenario
from k3load.workload.stored_requests import build_request

log = logging.getLogger("k3load")
DESIGN_FILE = "reuse_design.json"
VERSION = 1
SALTED = ("request", "pair")  # kinds whose requests (or pairs) each carry a salt of their own

Tokenize = Callable[[dict[str, Any]], list[int]]


class TokenizerUnavailable(Exception):
    """The server's /tokenize could not be used; the message says why (no secrets, one line)."""


def http_tokenizer(client_factory: Callable[[], httpx.Client], host: str, model: str) -> Tokenize:
    """`POST {host}/tokenize` with the chat fields vLLM's TokenizeChatRequest takes (the chat template is
    applied with the generation prompt, as for a chat completion); returns the token ids."""
    url = f"{host.rstrip('/')}/tokenize"

    def tokenize(body: dict[str, Any]) -> list[int]:
        payload = {"model": model, "messages": body["messages"], "add_generation_prompt": True}
        if body.get("tools"):
            payload["tools"] = body["tools"]
        try:
            with client_factory() as client:  # never follows a redirect: the key would go with it
                resp = client.post(url, json=payload, follow_redirects=False)
        except httpx.HTTPError as exc:
            raise TokenizerUnavailable(f"POST /tokenize failed: {type(exc).__name__}") from None
        if resp.status_code != 200:
            note = redirect_note(resp.status_code, resp.headers.get("location"), url)
            raise TokenizerUnavailable(f"POST /tokenize answered HTTP {resp.status_code}" + (note and f": {note}"))
        try:
            tokens = resp.json()["tokens"]
        except (ValueError, KeyError, TypeError):
            raise TokenizerUnavailable("POST /tokenize answered without a `tokens` list of integers") from None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise TokenizerUnavailable("POST /tokenize answered without a `tokens` list of integers")
        return tokens

    return tokenize


def variant_salts(scenario: Scenario, run_id: str) -> dict[str, str]:
    """The salts the run's users would use, in the same shape: one for unsalted and run-salted scenarios
    (every request carries the same one), two different ones for the salted kinds."""
    if scenario.prefix_salt == "run":
        return {"A": run_id}
    if scenario.prefix_salt == "request":
        return {"A": f"{run_id}/design-a/0", "B": f"{run_id}/design-b/1"}
    if scenario.prefix_salt == "pair":
        return {"A": f"pair-1/{run_id}/design-a", "B": f"pair-2/{run_id}/design-b"}
    return {"A": ""}


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common token prefix (compared a chunk at a time: long inputs share thousands)."""
    n, i, step = min(len(a), len(b)), 0, 256
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _body(scenario: Scenario, turn: int, model: str, salt: str, long_context: str | None,
          tools: bool = True) -> dict[str, Any]:
    body = json.loads(build_request(scenario, turn, model, salt, long_context).body)
    return body if tools else {k: v for k, v in body.items() if k != "tools"}


def _salt_position(scenario: Scenario, model: str, salts: dict[str, str], long_context: str | None,
                   tokenize: Tokenize) -> dict[str, Any]:
    """Where two differently salted requests part, with and without the tool declarations: when the
    tools come first in the rendered prompt, the tokens shared before the salt are the tool head."""
    with_tools = [tokenize(_body(scenario, 0, model, salts[v], long_context)) for v in ("A", "B")]
    shared = shared_prefix(*with_tools)
    out: dict[str, Any] = {"salt_at_token": shared, "tools_tokens": None, "tools_before_salt": None}
    if scenario.tools:
        bare = [tokenize(_body(scenario, 0, model, salts[v], long_context, tools=False)) for v in ("A", "B")]
        tools_tokens = len(with_tools[0]) - len(bare[0])
        out["tools_tokens"] = tools_tokens
        out["tools_before_salt"] = tools_tokens > 0 and shared - shared_prefix(*bare) >= tools_tokens / 2
    return out


def measure(scenarios: list[Scenario], run_id: str, model: str, long_context: Callable[[Scenario], str | None],
            tokenize: Tokenize) -> dict[str, Any]:
    """Every variant tokenized by the server, their lengths and shared prefixes (see the module doc)."""
    keys: list[str] = []
    tokens: list[list[int]] = []
    described: dict[str, Any] = {}
    for scenario in sorted(scenarios, key=lambda s: s.name):
        salts = variant_salts(scenario, run_id)
        context = long_context(scenario)
        info: dict[str, Any] = {"family": scenario.family, "mode": scenario.mode, "prefix_salt": scenario.prefix_salt,
                                "turns": len(scenario.turns)}
        for index in range(len(scenario.turns)):
            for variant, salt in salts.items():
                keys.append(f"{scenario.name}/{index}/{variant}")
                tokens.append(tokenize(_body(scenario, index, model, salt, context)))
        if scenario.prefix_salt in SALTED and scenario.turns:
            info |= _salt_position(scenario, model, salts, context, tokenize)
        described[scenario.name] = info
    matrix = [[shared_prefix(a, b) if j != i else len(a) for j, b in enumerate(tokens)] for i, a in enumerate(tokens)]
    return {"version": VERSION, "run_id": run_id, "model": model, "error": None,
            "measured_with": "POST /tokenize (messages, tools, add_generation_prompt: true)",
            "scenarios": described, "variants": keys, "prompt_tokens": [len(t) for t in tokens],
            "shared_prefix_tokens": matrix}


def measure_into(write_json: Callable[[str, Any], None], scenarios: list[Scenario], run_id: str, model: str,
                 long_context: Callable[[Scenario], str | None], tokenize: Tokenize) -> None:
    """`write_json(DESIGN_FILE, ...)`: the measurement, or the reason there is none. Raises only what the
    write raises: a run is never stopped by its design measurement. The writer is the run's own
    (`RunHold.write_json`, through the run directory's descriptor): this finishes beside the load, maybe
    after an operator moved the directory away, and must never land in a directory that replaced it."""
    try:
        design = measure(scenarios, run_id, model, long_context, tokenize)
    except TokenizerUnavailable as exc:
        design = {"version": VERSION, "run_id": run_id, "model": model, "error": str(exc)}
    except Exception as exc:  # a bug here must not end the run; it is said in the file
        log.exception("k3load: measuring the designed prefix reuse failed")
        design = {"version": VERSION, "run_id": run_id, "model": model,
                  "error": f"the measurement failed ({type(exc).__name__})"}
    write_json(DESIGN_FILE, design)
