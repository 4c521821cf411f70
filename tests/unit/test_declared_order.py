"""Requests go out in the key order their scenario declares, byte for byte (issue 25).

Why: a chat template renders a tool's properties, a response schema and every message in the order
the body gives them, so key order is part of the prompt; a client (or provider) that sorts keys sends
another prompt than the one declared. These tests read the shipped scenario files with plain
`yaml.safe_load` (not through the loader under test) and walk the stored samples against them, check
that `k3load samples --check` refuses a body whose keys were re-sorted, and that the serialiser keeps
any key order at any depth and changes only whitespace.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from k3load.workload import stored_requests_cli
from k3load.workload.scenario import parse_scenario
from k3load.workload.stored_requests import build_request, compact, order_difference, sha256

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((ROOT / "scenarios").glob("*.yaml"))
SAMPLES = ROOT / "samples" / "requests"
# The body's own top-level order, set by stored_requests._body (the harness declares these keys).
BODY_KEYS = ["model", "messages", "max_tokens", "temperature", "stream", "stream_options", "tools", "tool_choice",
             "response_format", "parallel_tool_calls"]


def key_orders(value: Any, where: str = "") -> Iterator[tuple[str, list[str]]]:
    """(path, keys in order) of every object in `value`, depth first."""
    if isinstance(value, dict):
        yield where or "(top level)", list(value)
        for key, item in value.items():
            yield from key_orders(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from key_orders(item, f"{where}[{i}]")


def _stored(name: str) -> list[dict[str, Any]]:
    paths = sorted((SAMPLES / name).glob("turn-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    assert paths, f"no stored samples for {name}"
    return [json.loads(p.read_bytes()) for p in paths]


def _declared_calls(data: dict[str, Any], before: int) -> list[dict[str, Any]]:
    """The scripted tool calls a conversation's history holds before turn `before`, in order."""
    if data.get("mode", "conversation") != "conversation":
        return []
    return [c for t in data["turns"][:before] for c in (t.get("reply") or {}).get("tool_calls", [])]


def _declared_result(data: dict[str, Any], call: dict[str, Any]) -> Any:
    executor = data["executors"][call["name"]]
    for row in executor.get("table", []):
        if row["match"].items() <= call["arguments"].items():
            return row["result"]
    return executor["default"]


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_stored_bodies_keep_the_declared_order_all_the_way_down(path):
    data = yaml.safe_load(path.read_text())
    context = data.get("context", [])
    for i, body in enumerate(_stored(data["name"])):
        where = f"{data['name']}/turn-{i}"
        assert list(body) == [k for k in BODY_KEYS if k in body], where
        assert list(key_orders(body.get("tools", []))) == list(key_orders(data.get("tools", []))), where
        turn = data["turns"][i]
        declared_format = turn.get("response_format", data.get("defaults", {}).get("response_format"))
        assert list(key_orders(body.get("response_format"))) == list(key_orders(declared_format)), where
        assert list(key_orders(body["messages"][1:1 + len(context)])) == list(key_orders(context)), where
        sent = [json.loads(c["function"]["arguments"]) for m in body["messages"] for c in m.get("tool_calls") or []]
        declared = [c["arguments"] for c in _declared_calls(data, i)]
        assert [list(key_orders(a)) for a in sent] == [list(key_orders(a)) for a in declared], where


def test_replayed_tool_results_keep_the_declared_order():
    data = yaml.safe_load((ROOT / "scenarios" / "agent_weather_trip.yaml").read_text())
    body = _stored(data["name"])[-1]
    sent = [json.loads(m["content"]) for m in body["messages"] if m["role"] == "tool"]
    declared = [_declared_result(data, c) for c in _declared_calls(data, len(data["turns"]) - 1)]
    assert sent and [list(key_orders(s)) for s in sent] == [list(key_orders(d)) for d in declared]


def test_a_salted_first_tool_keeps_its_order_and_gains_a_description_after_its_name():
    data = {"name": "t", "family": "cold", "system_prompt": "sys", "prefix_salt": "pair", "mode": "independent",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "executors": {"f": {"default": "ok"}}, "turns": [{"user": "hi", "expect": {"kind": "answer"}}]}
    scenario = parse_scenario(data, Path("t.yaml"))
    function = json.loads(build_request(scenario, 0, "m", salt="s1").body)["tools"][0]["function"]
    assert list(function) == ["name", "description", "parameters"] and function["description"] == "[session s1]"


def _samples(tmp_path: Path, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    stored_requests_cli.add_arguments(parser)
    args = parser.parse_args(["--scenarios", str(ROOT / "scenarios" / "agent_weather_trip.yaml"),
                              "--out", str(tmp_path), *argv])
    return stored_requests_cli.run(args)


def _rewrite(out: Path, rel: str, body: bytes) -> None:
    """Replace one stored body and its SHA256SUMS line, so only the bytes (the order) can differ."""
    old = (out / rel).read_bytes()
    (out / rel).write_bytes(body)
    sums = (out / "SHA256SUMS").read_text()
    (out / "SHA256SUMS").write_text(sums.replace(sha256(old), sha256(body)))


def test_samples_check_fails_on_a_body_re_serialised_with_sorted_keys(tmp_path, capsys):
    assert _samples(tmp_path) == 0
    rel = "agent_weather_trip/turn-3.json"
    resorted = json.dumps(json.loads((tmp_path / rel).read_bytes()), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False).encode()
    assert json.loads(resorted) == json.loads((tmp_path / rel).read_bytes())  # equal as JSON
    _rewrite(tmp_path, rel, resorted)
    capsys.readouterr()
    assert _samples(tmp_path, "--check") == 1
    out = capsys.readouterr().out
    assert f"{tmp_path / rel}: key order differs from what {ROOT / 'scenarios' / 'agent_weather_trip.yaml'} " \
           "declares: (top level): stored ['max_tokens', 'messages', 'model'," in out
    assert "k3load samples: stale" in out and out.count("key order differs") == 1


def test_samples_check_names_the_first_deep_key_path_whose_order_differs(tmp_path, capsys):
    _samples(tmp_path)
    rel = "agent_weather_trip/turn-3.json"
    body = json.loads((tmp_path / rel).read_bytes())
    properties = body["tools"][1]["function"]["parameters"]["properties"]
    body["tools"][1]["function"]["parameters"]["properties"] = {k: properties[k] for k in sorted(properties)}
    _rewrite(tmp_path, rel, compact(body))
    capsys.readouterr()
    assert _samples(tmp_path, "--check") == 1
    assert "tools[1].function.parameters.properties: stored ['loc', 'time', 'type'], declared ['loc', 'type', " \
           "'time']" in capsys.readouterr().out


def test_order_difference_looks_into_a_call_s_arguments():
    declared = {"messages": [{"tool_calls": [{"function": {"arguments": '{"loc":"x","type":"plus","time":1}'}}]}]}
    stored = {"messages": [{"tool_calls": [{"function": {"arguments": '{"loc":"x","time":1,"type":"plus"}'}}]}]}
    assert order_difference(stored, declared) == ("messages[0].tool_calls[0].function.arguments (JSON text): "
                                                  "stored ['loc', 'time', 'type'], declared ['loc', 'type', 'time']")
    assert order_difference(declared, declared) is None
    assert order_difference({"a": 1, "b": 2}, {"b": 2, "c": 3}) is None  # other keys: content, not order


def _keys() -> st.SearchStrategy[str]:
    return st.text(st.characters(codec="utf-8"), max_size=8)


_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | \
    st.text(st.characters(codec="utf-8"), max_size=12)
# An object's keys come in the order drawn (unique keys, then dict(), which keeps insertion order).
_JSON = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=4) | st.lists(
    st.tuples(_keys(), inner), max_size=5, unique_by=lambda kv: kv[0]).map(dict), max_leaves=30)


def _without_whitespace(text: str) -> str:
    """JSON text with the whitespace between tokens removed (strings kept whole)."""
    out, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch not in " \t\n\r":
            out.append(ch)
            in_string = ch == '"'
    return "".join(out)


@given(_JSON)
def test_compact_keeps_every_key_order_and_changes_only_whitespace(value):
    data = compact(value)
    assert list(key_orders(json.loads(data))) == list(key_orders(value))  # same order at every depth
    assert data.decode() == _without_whitespace(json.dumps(value, indent=2, ensure_ascii=False))
    assert compact(json.loads(data)) == data  # what is read back goes out again as the same bytes
