"""Unit tests of the sim's parts, no sockets: prefix cache, schema instances, plans, tokens."""

import json
import random
from pathlib import Path

import jsonschema
import pytest

from k3load.sim.config import FaultProfile, ProfileError, SimConfig, load_profile
from k3load.sim.faults import FaultDecision, apply_to_plan
from k3load.sim.generate import choose_tool, kimi_call_id, plan_output, truncate
from k3load.sim.prefix_cache import BlockPool, block_hashes, cacheable_hit_tokens
from k3load.sim.schema_instance import instance
from k3load.sim.tokenizer import prompt_token_ids, tokenize

BFCL = Path(__file__).parents[2] / "samples" / "tools" / "bfcl" / "BFCL_v4_live_simple.json"
_ALIASES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def _normalise(schema):
    """BFCL's loose types to JSON Schema, for validating with jsonschema."""
    if isinstance(schema, dict):
        out = {k: _normalise(v) for k, v in schema.items()}
        if isinstance(out.get("type"), str) and out["type"] in _ALIASES:
            if _ALIASES[out["type"]] is None:
                del out["type"]
            else:
                out["type"] = _ALIASES[out["type"]]
        return out
    if isinstance(schema, list):
        return [_normalise(v) for v in schema]
    return schema


def test_tokenize_round_trips_and_ids_are_stable():
    text = 'System: {"a": [1, 2]}\n  ünïcode — done.'
    assert "".join(tokenize(text)) == text
    msgs = [{"role": "user", "content": text}]
    assert prompt_token_ids(msgs, None) == prompt_token_ids(msgs, None)


def test_tool_order_changes_tokens_after_the_divergence_only():
    tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in ("a_tool", "b_tool")]
    msgs = [{"role": "system", "content": "x " * 200}, {"role": "user", "content": "q"}]
    one, two = prompt_token_ids(msgs, tools), prompt_token_ids(msgs, tools[::-1])
    assert one != two
    same = next(i for i, (x, y) in enumerate(zip(one, two, strict=False)) if x != y)
    assert same > 3  # the shared head stays identical


def test_block_hashes_chain_so_a_changed_head_changes_every_block():
    ids = list(range(64))
    base = block_hashes(ids, 16)
    assert len(base) == 4 and len(block_hashes(ids[:63], 16)) == 3
    changed = block_hashes([999, *ids[1:]], 16)
    assert all(a != b for a, b in zip(base, changed, strict=True))


def test_pool_hits_after_register_and_evicts_lru_when_full():
    pool = BlockPool(5)  # 4 to give: the first is vLLM's null block
    hashes = block_hashes(list(range(32)), 16)
    blocks = pool.allocate(2)
    assert 0 not in blocks
    for b, h in zip(blocks, hashes, strict=True):
        pool.register(b, h)
    pool.free(blocks)
    assert pool.lookup(hashes) == blocks and pool.usage() == 0.0
    pool.touch(blocks)
    assert pool.usage() == 0.5
    pool.free(blocks)
    assert pool.allocate(5) is None  # the null block is nobody's
    assert pool.allocate(4) is not None  # needs every block: the cached ones are evicted
    assert pool.lookup(hashes) == [] and pool.evictions == 2
    assert pool.allocate(1) is None


def test_hit_tokens_leave_the_last_token_and_align_to_the_hybrid_grid():
    assert cacheable_hit_tokens(8, 128, 16, 0) == 112  # whole prompt cached: last block recomputed
    assert cacheable_hit_tokens(5, 1000, 16, 0) == 80
    assert cacheable_hit_tokens(5, 1000, 16, 64) == 64
    assert cacheable_hit_tokens(3, 1000, 16, 64) == 0  # shorter than one checkpoint: no reuse


def _unsatisfiable(schema) -> bool:
    """BFCL has arrays carrying a string enum: no value can validate against those."""
    if isinstance(schema, dict):
        if schema.get("type") == "array" and any(not isinstance(e, list) for e in schema.get("enum", [])):
            return True
        return any(_unsatisfiable(v) for v in schema.values())
    return isinstance(schema, list) and any(_unsatisfiable(v) for v in schema)


def _bfcl_tools(limit=120):
    for line in BFCL.read_text().splitlines()[:limit]:
        for fn in json.loads(line)["function"]:
            if not _unsatisfiable(fn["parameters"]):
                yield fn


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generated_arguments_validate_against_real_bfcl_schemas(seed):
    rng = random.Random(seed)
    checked = 0
    for fn in _bfcl_tools():
        schema = _normalise(fn["parameters"])
        value = instance(fn["parameters"], rng)
        jsonschema.validate(value, schema)
        assert set(schema.get("required", [])) <= set(value)
        checked += 1
    assert checked >= 100


def test_instance_honours_enums_bounds_and_optional_fields():
    schema = {"type": "object", "required": ["n"], "properties": {
        "n": {"type": "integer", "minimum": 3, "maximum": 5},
        "x": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "e": {"type": "string", "enum": ["a", "b"]},
        "l": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 2}}}
    seen_optional = set()
    for seed in range(40):
        value = instance(schema, random.Random(seed))
        jsonschema.validate(value, schema)
        seen_optional |= set(value) - {"n"}
    assert seen_optional == {"x", "e", "l"}


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
STOCK = {"type": "function", "function": {"name": "get_stock_price", "description": "Price of a stock",
                                          "parameters": {"type": "object", "properties": {}}}}


def test_tool_choice_rules():
    ask = {"role": "user", "content": "what is the weather in Oslo?"}
    assert choose_tool({"messages": [ask], "tools": [STOCK, WEATHER]}) is WEATHER
    assert choose_tool({"messages": [ask], "tools": [STOCK, WEATHER], "tool_choice": "none"}) is None
    chat = {"role": "user", "content": "tell me a joke"}
    assert choose_tool({"messages": [chat], "tools": [STOCK, WEATHER]}) is None
    assert choose_tool({"messages": [chat], "tools": [STOCK, WEATHER], "tool_choice": "required"}) is STOCK
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert choose_tool({"messages": [chat], "tools": [STOCK, WEATHER], "tool_choice": named}) is WEATHER
    after = [ask, {"role": "assistant", "tool_calls": [{"id": "functions.get_weather:0"}]},
             {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    assert choose_tool({"messages": after, "tools": [WEATHER]}) is None
    assert kimi_call_id("get_weather", after) == "functions.get_weather:1"


def _plan(style="k3", **request):
    body = {"messages": [{"role": "user", "content": "weather in Oslo"}], "tools": [WEATHER], **request}
    return plan_output(body, random.Random(3), 5, 10, style)


def test_plans_k3_whole_call_and_k2_pieces():
    k3, k2 = _plan("k3"), _plan("k2")
    assert k3.finish_reason == k2.finish_reason == "tool_calls"
    whole = [p for p in k3.pieces if p.kind == "tool_whole"]
    assert len(whole) == 1 and json.loads(whole[0].text)["city"]
    args = "".join(p.text for p in k2.pieces if p.kind == "tool_args")
    assert json.loads(args) == json.loads(k2.tool_calls[0]["arguments"])


def test_truncate_and_ignore_eos():
    plan = plan_output({"messages": [{"role": "user", "content": "hi"}]}, random.Random(1), 0, 30, "k3")
    cut = truncate(plan, 4, False, random.Random(1))
    assert len(cut.pieces) == 4 and cut.finish_reason == "length"
    padded = truncate(plan, 200, True, random.Random(1))
    assert len(padded.pieces) == 200 and padded.finish_reason == "length"


def test_fault_rewrites_point_at_the_right_layer():
    plan = _plan("k3")
    bad = apply_to_plan(plan, FaultDecision(malformed_tool_args=True))
    with pytest.raises(json.JSONDecodeError):
        json.loads(next(p.text for p in bad.pieces if p.kind == "tool_whole"))
    empty = apply_to_plan(plan, FaultDecision(empty_tool_calls=True))
    assert empty.finish_reason == "tool_calls" and not any(p.kind.startswith("tool") for p in empty.pieces)
    markup = apply_to_plan(plan, FaultDecision(raw_tool_markup=True))
    assert "<|tool_calls_section_begin|>" in "".join(p.text for p in markup.pieces if p.kind == "content")
    leak = apply_to_plan(plan, FaultDecision(reasoning_leak=True))
    assert not any(p.kind == "reasoning" for p in leak.pieces)


def test_profile_rejects_unknown_and_mistyped_fields(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("engine:\n  num_gpu_blocks: 24\nfaults:\n  http_error_rate: 0.5\n")
    config = load_profile(good)
    assert config.num_gpu_blocks == 24 and config.faults.http_error_rate == 0.5
    for text, field in (("engine:\n  num_gpu_block: 1\n", "num_gpu_block"),
                        ("faults:\n  http_error_rate: lots\n", "http_error_rate"),
                        ("faults:\n  http_error_rate: 2\n", "http_error_rate"),
                        ("extra: {}\n", "top level")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ProfileError, match=field):
            load_profile(bad)
    assert SimConfig().faults == FaultProfile()
