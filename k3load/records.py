"""The Attempt record: one line of `DIR/records.jsonl.gz` (k3load.evidence) per HTTP attempt, written as it ends.

Why one record per attempt (not per request): retries are duplicate work the server really did, and
a verdict that hid them would flatter the deployment. Attempts of one request share `chain_id`.
Fields carry units; timestamps are wall-clock epoch seconds (`*_ts`); unknown is None, never 0.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from k3load.client.result import StreamResult
from k3load.evidence import lines
from k3load.quantile import nearest_rank


@dataclass
class Finding:
    """One validation check on one attempt; `layer` names who is to blame when `ok` is False."""

    check: str
    ok: bool
    layer: str | None = None
    detail: str = ""


@dataclass
class Attempt:
    """Everything the verdict needs to know about one attempt. Documented field by field in docs/records.md."""

    run_id: str
    attempt_id: str
    chain_id: str  # the request this attempt belongs to (shared by its retries)
    attempt: int  # 1 for the first try
    stage: str
    scenario: str
    family: str
    turn: int
    turn_kind: str  # expected behaviour: tool_call | answer | json
    user_id: str
    request_sha256: str  # of the exact bytes sent
    prefix_sha256: str  # of the shared part (system prompt, tools, fixed context)
    transport: str
    status: str
    send_ts: float
    end_ts: float
    first_byte_ts: float | None = None
    first_token_ts: float | None = None
    ttft_ms: float | None = None
    # Time to the first answer token: send to the first chunk that added content or a tool-call part,
    # after any reasoning (what a user of an agent waits for; the same as ttft_ms when the model did not
    # think first), and the thinking between them: first token to first answer token, None when the
    # answer had no reasoning. Both None when no answer token came or the answer was not streamed.
    ttfa_ms: float | None = None
    reasoning_ms: float | None = None
    itl_mean_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    decode_ms: float | None = None
    e2e_ms: float | None = None
    chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    max_tokens: int | None = None
    finish_reason: str | None = None
    http_status: int | None = None
    error: str | None = None
    error_body: str | None = None
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    valid: bool = True  # every finding ok
    failed_layers: list[str] = field(default_factory=list)
    will_retry: bool = False  # a later attempt of the same chain follows
    drill: bool = False  # sent with the scenario's deliberately short first_timeout_s (timeout drill)
    # Size of the exact body sent: the only measure of a request's input that survives a stream cut
    # before the server's usage chunk (a crash); None in records written before it existed.
    request_bytes: int | None = None
    # The one layer blamed for a failed attempt (None when valid); other failing findings of the
    # attempt are its consequences, kept in `findings` but counted once, under this layer.
    primary_layer: str | None = None
    # Prefix-cache control pairs: each cold request (a fresh salt) is followed by its warm twin (the
    # same bytes), so answers and latency compare like for like. None outside the control.
    control_pair: int | None = None
    control_role: str | None = None  # "cold" | "warm"
    stream: bool = True  # sent with `stream: true` (False: the whole body at once)
    # Tool-call cadence (streamed answers with a tool call; None otherwise): from the first chunk that
    # carried a tool-call part to the last one (the arguments' end), the longest silence inside the call,
    # the silence leading into its first delta included (a parser that holds a K3 call back until its
    # end marker streams nothing for that long), and how many chunks carried tool-call parts.
    tool_call_span_ms: float | None = None
    tool_call_max_gap_ms: float | None = None
    tool_call_deltas: int | None = None
    # Silence before the attempt ended: from the last token-bearing chunk (or the first event, the first
    # byte, the send) to the end; what tells a stall cut by our deadline from a deadline that was short.
    last_silence_ms: float | None = None
    # Streaming-equivalence drill: the same turn sent streamed and whole at once; both twins share
    # `stream_pair`, `stream_role` is "stream" or "whole". None outside the drill.
    stream_pair: str | None = None
    stream_role: str | None = None
    # A streamed answer ends at [DONE] (end_ts, e2e_ms): the body bytes that came after it (counted, never
    # waited for beyond a brief wait for the message's end), and whether the body was still open then (a
    # proxy holding it: its connection closed, not reused). None without [DONE] and in older records.
    after_done_bytes: int | None = None
    after_done_open: bool | None = None
    # The sampling the body asked for: its `temperature` and `seed` as sent (None where the body had none,
    # and in older records). They say whether a repeat of the same bytes is a new trial: at temperature 0,
    # or with a seed, it is not (analysis/run/clusters.py); above 0 without a seed every attempt is a new draw.
    temperature: float | None = None
    seed: int | None = None
    # What joins the record to the server's and the gateways' logs: the `X-Request-Id` this attempt sent
    # (k3load-<attempt_id>; vLLM takes it as its request id, `OpenAIServing._base_request_id`, so its chat
    # id is `chatcmpl-<it>`, and nginx logs it as `$http_x_request_id`) and the `id` the server answered.
    # None in older records, and response_id where no answer's id came.
    request_id: str | None = None
    response_id: str | None = None
    # How the stream reached the client (k3load.client.result): its socket reads up to [DONE] and their
    # bytes; many events per read in buffer-sized blocks is a proxy buffering it
    # (analysis/pillars/headroom/buffering.py).
    # None when not streamed, and in older records.
    stream_reads: int | None = None
    stream_bytes: int | None = None
    # The conversation this attempt belongs to: one playing of a scenario by one user (every turn, every
    # retry and both twins of a stream drill share it), so a session's goodput is every turn's
    # (analysis/pillars/headroom/goodput.py). The value the session header sends where --k3-session-header names one.
    # None in older records.
    session_id: str | None = None
    # Open-loop stages (a plan stage's `arrival`): when this request was meant to go, its session's arrival
    # for the first turn, the previous turn's end plus the agent's gap for later ones. `send_ts` later than
    # it is the generator running late (every session slot busy): coordinated omission, shown not hidden.
    # None for retries, closed-loop stages and older records.
    intended_send_ts: float | None = None
    # Whose answers the conversation's history held (k3load.workload.model_history): "scripted" (the scenario's
    # replies and results, whatever the server answered) or "model" (the model's own answers, its calls
    # executed and fed back). None in older records and outside a played scenario (a replay, a probe).
    history: str | None = None
    # history "model" only (None otherwise): the turn at which the conversation's history first differed from
    # the script (other calls, other arguments, a call where the script answered or the reverse, an extra round
    # or a skipped turn; None while on script: until then turns keep their expectations, after it they are
    # judged on validity alone); `model_round` 0 for a scripted turn's request, k for its k-th extra round
    # (the model's calls fed back before the next scripted turn; `turn` stays the scripted turn's index).
    off_script_turn: int | None = None
    model_round: int | None = None
    # history "model", set on a request's final answer: its calls that no executor or recorded result could
    # answer (each got the marked error result, model_history.NO_RESULT); the scripted turns skipped after it
    # (they carried only results of calls the model did not make); whether the extra rounds' cap ended the
    # model's calls (its last calls' results stay in the history, the next scripted turn follows them).
    unanswered_calls: int | None = None
    skipped_turns: int | None = None
    rounds_capped: bool | None = None
    # How the attempt came to be sent (k3load.workload.retry_policy.AttemptPath): "first_try", "retry" (the same
    # bytes again, `retry.when`) or "fallback" (the one attempt after exhausted retries, its body with the turn's
    # `fallback:` settings, judged by the turn's expectation minus what the fallback took away). None in older
    # records.
    path: str | None = None

    def to_json(self) -> str:
        """The record's line, the same bytes as `asdict`'s, without its deep copy of every field: a quarter
        of a millisecond per attempt on the worker's path (bench/peers.py's profile), serialised at once."""
        data = {name: getattr(self, name) for name in _ATTEMPT_FIELDS}
        data["findings"] = [{"check": f.check, "ok": f.ok, "layer": f.layer, "detail": f.detail} for f in self.findings]
        return json_line(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attempt:
        data = dict(data)
        data["findings"] = [Finding(**f) for f in data.get("findings", [])]
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in known})


_ATTEMPT_FIELDS = tuple(f.name for f in fields(Attempt))


def json_line(data: Any) -> str:
    """One JSON line that any UTF-8 file or message can carry, whatever text the server sent.

    Why not plain `ensure_ascii=False`: a lone surrogate (a JSON `"\\ud83d"` escape from the server,
    or a byte that was not UTF-8, kept by the client as U+DC80..U+DCFF) cannot be encoded as UTF-8,
    and the writer raised UnicodeEncodeError: the attempt had no record. Readable text stays as it is
    (compact, greppable); only a line that cannot be encoded is written with every non-ASCII
    character escaped, which `json.loads` reads back to the same string."""
    line = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    if not line.isascii():
        try:
            line.encode()
        except UnicodeEncodeError:
            return json.dumps(data, ensure_ascii=True, separators=(",", ":"))
    return line


TIMING_DECIMALS = 3  # milliseconds to the microsecond


def timing_fields(result: StreamResult) -> dict[str, float | int | None]:
    """TTFT, time to the first answer token (TTFA) and the reasoning before it, inter-token stats, decode
    time, tool-call cadence and the last silence (ms), keyed by Attempt field name, with what the end's
    time left out (`after_done_bytes`, `after_done_open`: the e2e time stops at [DONE]). A field that
    cannot be known for this attempt is left out (None in the record, never 0). Why the cadence beside
    the inter-token stats: a parser that holds a K3 call back until it is whole (vllm#50604) sends it in
    one delta after a long silence, which the averages hide and a client reads as slow decoding;
    `tool_call_max_gap_ms` is that silence, `tool_call_deltas` shows the call came in one piece."""
    out: dict[str, float | int | None] = {"e2e_ms": (result.end_ts - result.send_ts) * 1000}
    if result.after_done_bytes is not None:
        out["after_done_bytes"], out["after_done_open"] = result.after_done_bytes, result.after_done_open
    if result.first_token_ts is not None:
        out["ttft_ms"] = (result.first_token_ts - result.send_ts) * 1000
        out["decode_ms"] = (result.end_ts - result.first_token_ts) * 1000
    if result.first_answer_ts is not None:
        out["ttfa_ms"] = (result.first_answer_ts - result.send_ts) * 1000
        if result.reasoning and result.first_token_ts is not None:
            out["reasoning_ms"] = (result.first_answer_ts - result.first_token_ts) * 1000
    gaps = sorted((b - a) * 1000 for a, b in zip(result.chunk_ts, result.chunk_ts[1:], strict=False))
    if gaps:
        out["itl_mean_ms"] = statistics.fmean(gaps)
        out["itl_p50_ms"] = nearest_rank(gaps, 0.50)
        out["itl_p99_ms"] = nearest_rank(gaps, 0.99)
    out.update(tool_call_cadence(result))
    out["last_silence_ms"] = last_silence_ms(result)
    # Durations to the microsecond: one socket read's stamp resolves no finer, and full float digits made
    # the compressed record about a fifth larger than it needs be (compact evidence, docs/records.md).
    return {k: round(v, TIMING_DECIMALS) if type(v) is float and k.endswith("_ms") else v for k, v in out.items()}


def tool_call_cadence(result: StreamResult) -> dict[str, float | int]:
    """`tool_call_deltas`, `tool_call_span_ms`, `tool_call_max_gap_ms`; empty without a tool chunk.

    The span runs from the first chunk that carried a tool-call part to the last one. The longest gap
    is taken over the token-bearing chunks from the one just before the first tool chunk up to the
    last tool chunk, so the silence leading into a call counts: a K3 call held back by the parser is
    one delta after a long silence, and its span is 0. When the call is the answer's first token
    chunk, the lead-in is measured from the first SSE event (vLLM's role chunk, sent once prefill is
    done: prefill time is not the parser's); it is 0 when that event came in the same read as the call
    (a streamed result always has a first event: the call's own chunk is one)."""
    idx = result.tool_chunk_idx
    if not idx:
        return {}
    ts = result.chunk_ts
    first, last = idx[0], idx[-1]
    times = ts[first - 1:last + 1] if first else ts[:last + 1]
    lead_in = result.first_event_ts
    if not first and lead_in is not None and lead_in < ts[0]:
        times = [lead_in, *times]
    gap = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
    return {"tool_call_deltas": len(idx), "tool_call_span_ms": (ts[last] - ts[first]) * 1000,
            "tool_call_max_gap_ms": gap * 1000}


def last_silence_ms(result: StreamResult) -> float:
    """From the last sign of life to the attempt's end: the last token-bearing chunk, else the first
    SSE event (the stream began, no token came), else the response headers, else the send. Why: an
    attempt cut by our deadline after a long silence is a stall (the server stopped sending), not a
    deadline too short for a slow answer; a non-streamed answer's is the time its body took."""
    if result.chunk_ts:
        since = result.chunk_ts[-1]
    else:
        since = next((t for t in (result.first_event_ts, result.first_byte_ts) if t is not None), result.send_ts)
    return (result.end_ts - since) * 1000


def jsonl_lines(text: str) -> list[str]:
    """The lines of JSONL text, split at newlines only.

    Why not `str.splitlines()`: it also splits at U+2028, U+2029, U+0085 and the other Unicode line
    breaks, which JSON strings carry unescaped and `json_line` writes as they are (a model's answer may
    hold one): a record with one became two halves, "not an attempt record"."""
    return text.split("\n")


def read_records(path: Path) -> list[Attempt]:
    """Records of a file (`records.jsonl.gz`, or a legacy `records.jsonl`: k3load.evidence.lines); a torn
    last line (the writer was killed mid-write) is skipped, not fatal."""
    return list(iter_records(path))


def iter_records(path: Path) -> Iterator[Attempt]:
    """`read_records` one at a time: a reader that only counts (the validation summary) holds one record, never
    a day's."""
    for number, line in enumerate(lines(path), start=1):
        if not line.strip():
            continue
        try:
            attempt = Attempt.from_dict(json.loads(line))
        except (json.JSONDecodeError, TypeError) as exc:
            if not line.endswith("\n") and isinstance(exc, json.JSONDecodeError):
                return  # torn final line: only the last line can lack its "\n"
            raise ValueError(f"{path}:{number}: not an attempt record: {exc}") from exc
        yield attempt
