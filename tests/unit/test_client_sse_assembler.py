"""Chunk assembler on real vLLM 0.32 captures, recorded sim streams and hand-made shapes, no sockets: the
streamed answer is the non-streamed one, and a chunk that breaks the protocol is an AssemblyError.

Reference values come from outside the code under test: a plain `json.loads` reading of the same file
(tests/probes.py), the non-streamed capture of the same request, and the K2-style recording of the same
sim answer for the K3-style one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from k3load.client.assemble import TEXT, TOOL_PART, Assembler, AssemblyError, error_message
from k3load.client.result import StreamResult
from k3load.client.sse import DONE, SSEDecoder
from tests.probes import WIRE, read_capture, read_sse_capture
from tests.unit.sse_replay import SIM_WIRE, assemble, decode, snapshot

# streamed capture -> non-streamed capture of the same request (checked in test_capture_pairs_are_same_request)
PAIRS = {"stream_text.sse": "nonstream_text.json", "stream_tool_named.sse": "nonstream_tool.json",
         "stream_tool_auto.sse": "nonstream_tool_auto.json", "stream_tool_required.sse": "nonstream_tool_required.json",
         "stream_tool_parallel_required.sse": "nonstream_tool_parallel_required.json"}


def plain_concat(chunks: list[dict[str, Any]]) -> tuple[str, str, str]:
    """(reasoning, content, arguments of every call in order) by the dumbest possible reading."""
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    args = "".join(t["function"].get("arguments") or "" for d in deltas for t in d.get("tool_calls") or [])
    return ("".join(d.get("reasoning") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas), args)


# -- assembler on real vLLM captures ---------------------------------------------------------------
def test_capture_pairs_are_same_request() -> None:
    def strip(request: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in request.items() if k not in ("stream", "stream_options")}

    for streamed, whole in PAIRS.items():
        meta = json.loads((WIRE / streamed.replace(".sse", ".meta.json")).read_text())
        assert strip(meta["request"]) == strip(read_capture(whole)["request"])


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_streamed_answer_equals_the_non_streamed_one(name: str) -> None:
    asm, tokens = assemble(decode((WIRE / name).read_bytes()))
    body = read_capture(PAIRS[name])["body"]
    whole = Assembler()
    whole.add_completion(body)
    message = body["choices"][0]["message"]
    reasoning, content, arguments = plain_concat(read_sse_capture(name))
    assert (asm.reasoning, asm.content) == (reasoning, content) == (message["reasoning"] or "", whole.content)
    assert "".join(c.arguments for c in asm.tool_calls) == arguments
    meta = json.loads((WIRE / name.replace(".sse", ".meta.json")).read_text())
    if message.get("tool_calls"):  # the tiny model's required array never closed: no calls in the message
        assert [(c.name, json.loads(c.arguments)) for c in asm.tool_calls] == [
            (c.name, json.loads(c.arguments)) for c in whole.tool_calls]
        if meta["request"]["tool_choice"] != "required":  # required: vLLM re-serialises the whole answer's
            assert [c.arguments for c in asm.tool_calls] == [c.arguments for c in whole.tool_calls]
    if not (meta["request"].get("stream_options") or {}).get("include_usage"):
        assert asm.usage is None
        return
    streamed, reported = snapshot(asm), StreamResult("ok", "none", 0.0, 0.0, usage=body["usage"])
    assert (streamed.prompt_tokens, streamed.completion_tokens, streamed.cached_tokens) == (
        reported.prompt_tokens, reported.completion_tokens, reported.cached_tokens)
    assert tokens <= streamed.completion_tokens


def test_last_token_in_the_finish_chunk_is_kept() -> None:
    asm, tokens = assemble(decode((WIRE / "stream_text.sse").read_bytes()))
    assert asm.finish_reason == "length" and asm.content == " strings" * 16
    assert tokens == asm.usage["completion_tokens"] == 16  # the 16th token came with finish_reason
    assert asm.response_id == "chatcmpl-97ac8870fcbaea0f" and asm.usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_required_tool_call_with_null_names_and_cached_tokens() -> None:
    asm, _ = assemble(decode((WIRE / "stream_tool_required.sse").read_bytes()))
    (call,) = asm.tool_calls
    assert call.id == "chatcmpl-tool-a822ddc52bd6584f" and call.name == "get_weather"
    assert call.arguments == plain_concat(read_sse_capture("stream_tool_required.sse"))[2]
    assert asm.finish_reason == "length" and asm.usage["prompt_tokens_details"]["cached_tokens"] == 256


def test_real_parallel_calls_reassemble_to_the_non_streamed_calls() -> None:
    """SmolLM2 behind vLLM 0.32, tool_choice required: two calls, each a header delta (id, name, the
    first argument token) then one delta per argument token; index 1 opens once index 0 is done."""
    events = decode((WIRE / "stream_tool_parallel_required.sse").read_bytes())
    asm = Assembler()
    added = [asm.add(e) for e in events if e is not DONE]  # type: ignore[arg-type]
    whole = read_capture("nonstream_tool_parallel_required.json")["body"]["choices"][0]["message"]["tool_calls"]
    got = [(c.index, c.name, json.loads(c.arguments)) for c in asm.tool_calls]
    assert got == [(i, c["function"]["name"], json.loads(c["function"]["arguments"])) for i, c in enumerate(whole)]
    assert [a["city"] for _, _, a in got] == ["Paris", "Oslo"] and asm.finish_reason == "tool_calls"
    assert len({c.id for c in asm.tool_calls}) == 2 and asm.content == asm.reasoning == ""
    indices = [t["index"] for e in read_sse_capture("stream_tool_parallel_required.sse") if e.get("choices")
               for t in e["choices"][0]["delta"].get("tool_calls") or []]
    assert indices == sorted(indices) and (indices.count(0), indices.count(1)) == (12, 13)  # one after the other
    assert added.count(TOOL_PART) == 25 == len(indices) and set(added) == {0, TOOL_PART}  # role, finish, usage: 0
    # the whole answer's arguments are re-serialised (json.dumps spacing), the streamed ones are the tokens
    assert asm.tool_calls[0].arguments == '{"city":"Paris","unit":"celsius"}' != whole[0]["function"]["arguments"]


def test_no_usage_when_not_asked() -> None:
    asm, _ = assemble(decode((WIRE / "stream_text_no_usage.sse").read_bytes()))
    assert asm.usage is None and asm.finish_reason == "length"


# -- assembler on sim recordings (K3 whole calls) --------------------------------------------------
@pytest.mark.parametrize("choice", ["auto", "named"])
def test_k3_whole_call_equals_k2_pieces_of_the_same_answer(choice: str) -> None:
    k3_events = decode((SIM_WIRE / f"k3_tool_{choice}.sse").read_bytes())
    k3, _ = assemble(k3_events)
    k2, _ = assemble(decode((SIM_WIRE / f"k2_tool_{choice}.sse").read_bytes()))
    whole = [e for e in k3_events if e is not DONE and any(
        t["function"].get("arguments") for c in e.get("choices", []) for t in c["delta"].get("tool_calls") or [])]
    assert len(whole) == 1  # K3: the call arrives in one delta with complete arguments
    assert [(c.id, c.name, c.arguments) for c in k3.tool_calls] == [(c.id, c.name, c.arguments) for c in k2.tool_calls]
    assert json.loads(k3.tool_calls[0].arguments)["city"] and k3.reasoning == k2.reasoning != ""
    assert k3.finish_reason == ("stop" if choice == "named" else "tool_calls")
    assert k3.usage["completion_tokens_details"]["reasoning_tokens"] > 0


def test_legacy_reasoning_content_and_both_fields() -> None:
    raw = (SIM_WIRE / "k3_text_reasoning.sse").read_bytes()
    modern, _ = assemble(decode(raw))
    legacy, _ = assemble(decode(raw.replace(b'"reasoning":', b'"reasoning_content":')))
    both, _ = assemble(decode(raw.replace(b'{"reasoning":', b'{"reasoning_content":"x","reasoning":')))
    assert modern.reasoning.startswith("Let me think.") and modern.content
    assert legacy.reasoning == both.reasoning == modern.reasoning


def test_midstream_error_and_cut_stream_recordings() -> None:
    events = decode((SIM_WIRE / "midstream_error.sse").read_bytes())
    asm, _ = assemble(events)
    assert events[-1] is DONE and asm.content and asm.finish_reason is None
    assert error_message(asm.error) == "InternalServerError (500): k3load sim: injected engine error mid-stream"
    decoder = SSEDecoder()
    decoder.feed((SIM_WIRE / "truncated.sse").read_bytes())
    assert not decoder.done and decoder.finish() == []


def test_non_streamed_bodies() -> None:
    sim = Assembler()
    sim.add_completion(json.loads((SIM_WIRE / "nonstream_k3_tool.json").read_text())["body"])
    assert sim.reasoning.startswith("Let me think.") and sim.finish_reason == "tool_calls"
    assert sim.tool_calls[0].id == "functions.get_weather:0" and json.loads(sim.tool_calls[0].arguments)
    err = Assembler()
    err.add_completion(read_capture("error_context_length.json")["body"])
    assert "maximum context length is 2048" in error_message(err.error)


# -- assembler on hand-made shapes -----------------------------------------------------------------
def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _call(index: int, *, call_id: str | None = None, name: str | None = None,
          arguments: str | None = None) -> dict[str, Any]:
    function = {"arguments": arguments} if name is None else {"name": name, "arguments": arguments}
    return {"index": index, **({"id": call_id, "type": "function"} if call_id else {}), "function": function}


def _calls(asm: Assembler) -> list[tuple[int, str | None, str | None, dict[str, Any]]]:
    return [(c.index, c.id, c.name, json.loads(c.arguments)) for c in asm.tool_calls]


PARIS, OSLO = (0, "a", "w", {"city": "Paris"}), (1, "b", "w", {"city": "Oslo"})


def _k2_pieces(index: int, city: str) -> list[dict[str, Any]]:
    return [_call(index, arguments=p) for p in ('{"ci', 'ty": "', city, '"}')]


@pytest.mark.parametrize(("name", "deltas"), [
    ("K2, one call after the other", [
        _call(0, call_id="a", name="w", arguments=""), *_k2_pieces(0, "Paris"),
        _call(1, call_id="b", name="w", arguments=""), *_k2_pieces(1, "Oslo")]),
    ("K2, argument deltas interleaved 0, 1, 0, 1", [
        _call(0, call_id="a", name="w"), _call(1, call_id="b", name="w"),
        *(d for pair in zip(_k2_pieces(0, "Paris"), _k2_pieces(1, "Oslo"), strict=True) for d in pair)]),
    ("K3, each call whole in one delta", [
        _call(0, call_id="a", name="w", arguments='{"city": "Paris"}'),
        _call(1, call_id="b", name="w", arguments='{"city": "Oslo"}')]),
])
def test_parallel_calls_merge_by_index(name: str, deltas: list[dict[str, Any]]) -> None:
    one_per_chunk, all_in_one = Assembler(), Assembler()
    assert all(one_per_chunk.add(_chunk({"tool_calls": [d]})) == TOOL_PART for d in deltas), name
    assert all_in_one.add(_chunk({"tool_calls": deltas})) == TOOL_PART
    assert _calls(one_per_chunk) == _calls(all_in_one) == [PARIS, OSLO], name


def test_what_each_chunk_adds() -> None:
    asm = Assembler()
    assert asm.add(_chunk({"role": "assistant", "content": ""})) == 0  # vLLM's role chunk
    assert asm.add(_chunk({"reasoning": "hm"})) == TEXT
    assert asm.add(_chunk({"content": "", "tool_calls": []})) == 0  # an empty array adds nothing
    assert asm.add(_chunk({"tool_calls": [_call(0, call_id="a", name="w")]})) == TOOL_PART  # the header alone
    assert asm.add(_chunk({"tool_calls": [_call(0, arguments="")]})) == 0  # empty arguments
    assert asm.add(_chunk({"tool_calls": [_call(0, call_id="a", name="w", arguments="")]})) == 0  # repeated
    assert asm.add(_chunk({"tool_calls": [{"index": 0, "function": {"name": None, "arguments": "{}"}}]})) == TOOL_PART
    assert asm.add(_chunk({"content": "x", "tool_calls": [_call(1, call_id="b", name="v")]})) == TEXT | TOOL_PART
    assert asm.add(_chunk({}, "stop")) == 0 and asm.add({"id": "c1", "choices": [], "usage": {}}) == 0
    assert asm.add(_chunk({"content": "last"}, "length")) == TEXT and asm.finish_reason == "length"
    assert [(c.index, c.id, c.name, c.arguments) for c in asm.tool_calls] == [(0, "a", "w", "{}"), (1, "b", "v", "")]


def test_an_empty_tool_calls_stream_has_no_calls() -> None:
    asm = Assembler()
    added = [asm.add(_chunk({"tool_calls": []})) for _ in range(3)] + [asm.add(_chunk({"content": "no call"}, "stop"))]
    assert added == [0, 0, 0, TEXT] and asm.tool_calls == [] and asm.content == "no call"


def test_a_duplicate_call_under_a_new_index_is_kept_as_sent() -> None:
    """The same id (and call) again under index 1: two calls, as the server sent them; a duplicate is
    validation's to judge, not the assembler's to hide."""
    asm = Assembler()
    whole = '{"city": "Paris"}'
    for index in (0, 1):
        assert asm.add(_chunk({"tool_calls": [_call(index, call_id="a", name="w", arguments=whole)]})) == TOOL_PART
    assert _calls(asm) == [PARIS, (1, "a", "w", {"city": "Paris"})]


@pytest.mark.parametrize("chunk", [
    {"choices": {"index": 0}},
    {"choices": [{"index": 1, "delta": {"content": "x"}}]},
    _chunk({"content": ["x"]}),
    _chunk({"tool_calls": {"index": 0}}),
    _chunk({"tool_calls": ["x"]}),
    _chunk({"tool_calls": [{"index": "0", "function": {"arguments": "{}"}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": {"city": "Paris"}}}]}),
])
def test_protocol_breaking_chunks_raise_assembly_error(chunk: dict[str, Any]) -> None:
    with pytest.raises(AssemblyError):
        Assembler().add(chunk)


def test_renamed_call_and_bad_bodies_raise_assembly_error() -> None:
    asm = Assembler()
    asm.add(_chunk({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "w"}}]}))
    with pytest.raises(AssemblyError, match="renamed"):
        asm.add(_chunk({"tool_calls": [{"index": 0, "function": {"name": "v"}}]}))
    bad_bodies = ([], {"choices": []}, {"choices": [{"message": "hi"}]},
                  {"choices": [{"message": {"tool_calls": [1]}}]})
    for body in bad_bodies:
        with pytest.raises(AssemblyError):
            Assembler().add_completion(body)
