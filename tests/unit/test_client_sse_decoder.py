"""SSE decoder on real vLLM 0.32 captures and recorded sim streams, no sockets: the events whatever the
reads' cuts, and every malformed input a typed error with its position.

Reference values come from outside the code under test: a plain `splitlines` + `json.loads` reading of
the same file (tests/probes.py).
"""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from k3load.client.sse import DONE, SSEDecoder, SSEError, SSEEvent, SSEFormatError, SSEJSONError, SSELineTooLong
from tests.probes import WIRE, read_sse_capture
from tests.unit.sse_replay import SIM_WIRE, assemble, decode, snapshot

VLLM_OK_STREAMS = sorted(p.name for p in WIRE.glob("stream_*.sse"))
SIM_STREAMS = sorted(p.name for p in SIM_WIRE.glob("*.sse"))


def random_cuts(raw: bytes, rng: random.Random) -> list[int]:
    """Cut points from 1-byte to 600-byte reads: mid-line, mid-`data:`, mid-UTF-8, between \\r and \\n."""
    cuts, pos = [], 0
    while True:
        pos += rng.choice((1, 2, 3, 7, rng.randint(1, 600)))
        if pos >= len(raw):
            return cuts
        cuts.append(pos)


# -- decoder ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", VLLM_OK_STREAMS)
def test_vllm_capture_decodes_to_what_a_line_reader_sees(name: str) -> None:
    events = decode((WIRE / name).read_bytes())
    assert events[-1] is DONE and DONE not in events[:-1]
    assert events[:-1] == read_sse_capture(name)


@pytest.mark.parametrize("name", VLLM_OK_STREAMS + [f"sim/{n}" for n in SIM_STREAMS])
def test_random_splits_decode_and_assemble_identically(name: str) -> None:
    raw = (WIRE.parent / name).read_bytes() if name.startswith("sim/") else (WIRE / name).read_bytes()
    whole = decode(raw)
    reference = snapshot(assemble(whole)[0])
    rng = random.Random(f"splits:{name}")
    for _ in range(20):
        events = decode(raw, random_cuts(raw, rng))
        assert events == whole
        assert snapshot(assemble(events)[0]) == reference


def test_one_byte_reads_and_crlf_line_ends() -> None:
    raw = (WIRE / "stream_tool_named.sse").read_bytes()
    whole = decode(raw)
    assert decode(raw, list(range(1, len(raw)))) == whole
    crlf = raw.replace(b"\n", b"\r\n")
    assert decode(crlf, list(range(1, len(crlf)))) == whole  # includes every cut between \r and \n


def test_multibyte_utf8_cut_at_every_byte() -> None:
    text = "héllo — 日本語 🙂 ñ"
    chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    raw = b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\ndata: [DONE]\n\n"
    for cut in range(1, len(raw)):
        events = decode(raw, [cut])
        assert events[0]["choices"][0]["delta"]["content"] == text and events[1] is DONE


def test_comments_fields_and_multiline_data() -> None:
    raw = (b": keep-alive ping\n\nevent: message\nid: 7\nretry: 100\ndata: {\"a\":\ndata: 1}\n\n"
           b"data:{\"b\":2}\n\ndata: [DONE]\n\n")
    assert decode(raw) == [{"a": 1}, {"b": 2}, DONE]


def test_finish_dispatches_an_event_missing_its_blank_line_and_keeps_partial_lines_out() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a":1}\n\ndata: [DONE]\n') == [{"a": 1}]
    assert decoder.finish() == [DONE] and decoder.done
    cut = SSEDecoder()
    assert cut.feed(b'data: {"a":1}\n\ndata: {"b":') == [{"a": 1}]
    assert cut.finish() == [] and cut.pending_bytes == len(b'data: {"b":') and not cut.done


@pytest.mark.parametrize(("raw", "error", "words"), [
    (b'data: {"a":1}\n\n<html>502 Bad Gateway</html>\n', SSEFormatError, "line 3"),
    (b"garbage without colon\n", SSEFormatError, "not an SSE field"),
    (b"retry_later: 5\n", SSEFormatError, "retry_later"),
    (b'data: {"a":1,}\n\n', SSEJSONError, "invalid JSON"),
    (b"data: [1, 2]\n\n", SSEJSONError, "not an object"),
    (b"data: {\"a\": \xff\xfe}\n\n", SSEJSONError, "invalid JSON"),  # not UTF-8, and not JSON either
])
def test_malformed_input_is_a_typed_error_with_position(raw: bytes, error: type[SSEError], words: str) -> None:
    with pytest.raises(error) as caught:
        decode(raw, [3])
    assert isinstance(caught.value, ValueError) and words in str(caught.value) and "\n" not in str(caught.value)


def test_invalid_utf8_is_kept_escaped_and_counted() -> None:
    """Bytes that are not UTF-8 are kept as lone surrogates (the original bytes come back with
    surrogateescape); the decoder counts the events, for the client to call the stream malformed."""
    raw = b'data: {"a": "ok\xff\xfe"}\n\ndata: {"a": "\\ud83d"}\n\ndata: [DONE]\n\n'
    decoder = SSEDecoder()
    events = [e for cut in range(0, len(raw), 5) for e in decoder.feed(raw[cut:cut + 5])] + decoder.finish()
    assert events == [{"a": "ok\udcff\udcfe"}, {"a": "\ud83d"}, DONE] and decoder.invalid_utf8 == 1
    assert events[0]["a"].encode("utf-8", "surrogateescape") == b"ok\xff\xfe"


def test_a_long_line_is_held_as_its_reads_never_rejoined() -> None:
    """Linear by design: while a line is unfinished, each read is kept as the very object fed (no
    re-join, no re-split of what came before) and only the new read is searched for the line end;
    the line is joined once, when its end arrives. (bench/sse_long_line.py times it.)"""
    payload = b'data: {"content": "' + b"x" * (20 << 20) + b'"}\n\ndata: [DONE]\n\n'
    pieces = [payload[i:i + (64 << 10)] for i in range(0, len(payload), 64 << 10)]
    decoder = SSEDecoder(max_line_bytes=32 << 20)
    for piece in pieces[:-1]:
        assert decoder.feed(piece) == []
    assert all(a is b for a, b in zip(decoder._parts, pieces[:-1], strict=True))
    assert decoder.pending_bytes == sum(map(len, pieces[:-1]))
    (event, done) = decoder.feed(pieces[-1])
    assert len(event["content"]) == 20 << 20 and done is DONE and decoder.pending_bytes == 0


@pytest.mark.parametrize("read_bytes", [7, 64 << 10, 8 << 20])
def test_a_line_over_the_cap_is_counted_and_hashed_not_held(read_bytes: int) -> None:
    line = b'data: {"content": "' + b"y" * (3 << 20) + b'"}'
    raw = b'data: {"a":1}\n\n' + line + b"\n\ndata: [DONE]\n\n"
    decoder = SSEDecoder(max_line_bytes=1 << 20)
    events: list[SSEEvent] = []
    with pytest.raises(SSELineTooLong) as caught:
        for cut in range(0, len(raw), read_bytes):
            events += decoder.feed(raw[cut:cut + read_bytes])
            assert decoder._over is not None or decoder.pending_bytes <= (1 << 20) + read_bytes
            assert decoder._over is None or not decoder._parts  # past the cap nothing is held
    assert f"line over {1 << 20} bytes ({len(line)} bytes, sha256 {hashlib.sha256(line).hexdigest()})" \
        in str(caught.value)
    assert "SSE line 3" in str(caught.value) and caught.value.excerpt.startswith(b'data: {"content": "yyy')
    assert events == ([{"a": 1}] if read_bytes < len(raw) else [])


def test_a_line_over_the_cap_cut_by_eof_is_too_long() -> None:
    decoder = SSEDecoder(max_line_bytes=100)
    assert decoder.feed(b"data: " + b"z" * 200) == [] and decoder.pending_bytes == 206
    with pytest.raises(SSELineTooLong, match="206 bytes"):
        decoder.finish()


def test_a_json_error_body_read_as_sse_is_a_format_error() -> None:
    with pytest.raises(SSEFormatError, match="line 1"):
        decode((WIRE / "error_context_length_stream.sse").read_bytes())

