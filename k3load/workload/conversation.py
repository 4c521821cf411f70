"""Play a scenario against a server: build each turn's bytes, send, validate, retry, record.

Why here and not in the locustfile: the same conversation logic must run under Locust, in tests
and from a plain script; Locust only decides when and how many. Every attempt goes to `sink` the
moment it ends (the Locust glue turns it into events and a JSONL line).

One record per request sent, whatever comes back: an exception of ours once the request is sent (the
client's, timing, validation, the twins' comparison, building the record) becomes the record of the
answer as received with a `harness.error` finding (k3load.workload.harness_error), is never retried, and
is handed to `RunContext.on_unjudged` after the sink (the console counts it); nothing from the answer
leaves the turn as an exception. What the sink itself raises (the record could not be written) does.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from k3load.client.result import (
    STATUS_CLIENT_RAISED,
    StreamResult,
)
from k3load.records import Attempt, Finding, timing_fields
from k3load.workload import harness_error, model_history
from k3load.workload.harness_error import HarnessFault
from k3load.workload.model_history import Body
from k3load.workload.retry_policy import (
    AttemptPath,
    drill_deadline_s,
    fallback_body,
    fallback_turn,
    retry_reason,
    retry_wait_s,
)
from k3load.workload.run_context import REQUEST_ID_HEADER as REQUEST_ID_HEADER  # re-exported for callers
from k3load.workload.run_context import Client as Client
from k3load.workload.run_context import RunContext as RunContext
from k3load.workload.run_context import StreamDrill as StreamDrill
from k3load.workload.run_context import one_after_other as one_after_other
from k3load.workload.run_context import request_id_of as request_id_of
from k3load.workload.scenario import Scenario, Turn
from k3load.workload.stored_requests import PreparedRequest, build_request, compact, sha256
from k3load.workload.stream_equivalence import compare_twins
from k3load.workload.think_time import gap_before
from k3load.workload.validate import primary_layer, validate


def make_attempt(ctx: RunContext, scenario: Scenario, turn: Turn, prepared: PreparedRequest, result: StreamResult,
                 findings: list[Finding], chain_id: str, number: int, will_retry: bool,
                 timing: dict[str, Any] | None = None, attempt_id: str | None = None,
                 path: AttemptPath | None = None, stage: str | None = None) -> Attempt:
    """`stage`: the stage the attempt was sent in (`Judged.stage`); None: the stage now."""
    failed = sorted({f.layer for f in findings if not f.ok and f.layer})
    attempt_id = attempt_id or uuid.uuid4().hex
    return Attempt(
        run_id=ctx.run_id, attempt_id=attempt_id, request_id=request_id_of(attempt_id),
        response_id=result.response_id, stream_reads=result.stream_reads, stream_bytes=result.stream_bytes,
        chain_id=chain_id, attempt=number, stage=ctx.stage() if stage is None else stage,
        scenario=scenario.name, family=scenario.family, turn=turn.index, turn_kind=turn.kind,
        user_id=ctx.user_id, request_sha256=prepared.sha256, prefix_sha256=prepared.prefix_sha256,
        request_bytes=len(prepared.body),
        transport=result.transport, status=result.status, send_ts=result.send_ts, end_ts=result.end_ts,
        first_byte_ts=result.first_byte_ts, first_token_ts=result.first_token_ts, chunks=len(result.chunk_ts),
        prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_tokens, reasoning_tokens=result.reasoning_tokens,
        max_tokens=turn.settings["max_tokens"], finish_reason=result.finish_reason,
        http_status=result.http_status, error=result.error, error_body=result.error_body,
        reasoning=result.reasoning, content=result.content,
        tool_calls=[c.as_message() for c in result.tool_calls], findings=findings,
        valid=all(f.ok for f in findings), failed_layers=failed, primary_layer=primary_layer(findings),
        will_retry=will_retry, stream=turn.settings["stream"], temperature=turn.settings.get("temperature"),
        seed=turn.settings.get("seed"), path=_path(path, number),
        **(timing if timing is not None else timing_fields(result)))


def _path(path: AttemptPath | None, number: int) -> str:
    """The record's `path`: as given, else the first try or a retry by its number (a plain str on the wire)."""
    return (path or (AttemptPath.FIRST_TRY if number == 1 else AttemptPath.RETRY)).value


@dataclass
class Judged:
    """One answer and its findings; `fault` set when the harness could not judge it (its findings are then the
    one `harness.error`), `timing` None when it could not be timed."""

    result: StreamResult
    findings: list[Finding]
    timing: dict[str, Any] | None
    fault: HarnessFault | None = None
    # The record's id, drawn before the send: the request carried it (request_id_of) as its X-Request-Id
    attempt_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # The stage it was sent in, read before the send: a search's steps follow each other with no drain, so an
    # answer still streaming when its step is decided belongs to that step, not to the next (None: unknown)
    stage: str | None = None


def send_and_judge(client: Client, ctx: RunContext, scenario: Scenario, turn: Turn, body: bytes,
                   deadline_s: float, session_id: str | None = None) -> Judged:
    """Send, time and validate one attempt; never raises an Exception (see the module docstring). The
    request carries its record's id as `X-Request-Id`, and the conversation's id in the session header."""
    attempt_id, send_ts = uuid.uuid4().hex, time.time()
    try:
        stage: str | None = str(ctx.stage())
    except Exception:  # the record says the stage when it is built, or "unknown" (bare_attempt)
        stage = None
    headers = {REQUEST_ID_HEADER: request_id_of(attempt_id)}
    if ctx.session_header and session_id:
        headers[ctx.session_header] = session_id
    try:
        result = client.send(body, deadline_s, headers=headers)
    except Exception as exc:  # the client's own bug: the request may be out, so it is recorded
        fault = HarnessFault.of(exc, harness_error.PHASE_SEND)
        result = harness_error.unanswered(getattr(client, "transport", "unknown"), send_ts, time.time(), fault)
        return Judged(result, [harness_error.finding(fault, result)], None, fault, attempt_id, stage)
    phase, timing = harness_error.PHASE_TIMING, None
    try:
        timing = timing_fields(result)
        phase = harness_error.PHASE_VALIDATE
        return Judged(result, validate(result, scenario, turn, timing, ctx.max_tool_call_gap_ms), timing,
                      attempt_id=attempt_id, stage=stage)
    except Exception as exc:  # a RecursionError in a hostile answer, a bug: recorded as received
        fault = HarnessFault.of(exc, phase)
        return Judged(result, [harness_error.finding(fault, result)], timing, fault, attempt_id, stage)


def record_of(ctx: RunContext, scenario: Scenario, turn: Turn, prepared: PreparedRequest, judged: Judged,
              chain_id: str, number: int, will_retry: bool, path: AttemptPath | None = None) -> Attempt:
    """`make_attempt`, or, where building the record raised, the answer as received with a `harness.error`
    finding (a bare record where even that cannot be built): never raises an Exception."""
    try:
        return make_attempt(ctx, scenario, turn, prepared, judged.result, judged.findings, chain_id, number,
                            will_retry, judged.timing, judged.attempt_id, path, judged.stage)
    except Exception as exc:
        fault = HarnessFault.of(exc, harness_error.PHASE_RECORD)
    findings = [harness_error.finding(fault, judged.result)]
    try:
        return make_attempt(ctx, scenario, turn, prepared, judged.result, findings, chain_id, number, False,
                            judged.timing or {}, judged.attempt_id, path, judged.stage)
    except Exception:
        return bare_attempt(ctx, scenario, turn, prepared, judged.result, findings, chain_id, number,
                            judged.attempt_id, path, judged.stage)


def bare_attempt(ctx: RunContext, scenario: Scenario, turn: Turn, prepared: PreparedRequest, result: StreamResult,
                 findings: list[Finding], chain_id: str, number: int, attempt_id: str | None = None,
                 path: AttemptPath | None = None, stage: str | None = None) -> Attempt:
    """The record with only what is certain to read: identity, status, times, the text as strings; `stage`: the
    one it was sent in (None: the stage now, or "unknown")."""
    def text(value: Any) -> str:
        return value if isinstance(value, str) else ""

    def number_or_none(value: Any) -> float | None:
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    if stage is None:
        try:
            stage = str(ctx.stage())
        except Exception:
            stage = "unknown"
    send_ts = number_or_none(getattr(result, "send_ts", None)) or time.time()
    end_ts = number_or_none(getattr(result, "end_ts", None)) or send_ts
    http = getattr(result, "http_status", None)
    attempt_id = attempt_id if isinstance(attempt_id, str) and attempt_id else uuid.uuid4().hex
    return Attempt(
        run_id=ctx.run_id, attempt_id=attempt_id, request_id=request_id_of(attempt_id), chain_id=chain_id,
        attempt=number, stage=stage,
        scenario=scenario.name, family=scenario.family, turn=turn.index, turn_kind=turn.kind, user_id=ctx.user_id,
        request_sha256=prepared.sha256, prefix_sha256=prepared.prefix_sha256, request_bytes=len(prepared.body),
        transport=text(getattr(result, "transport", "")),
        status=text(getattr(result, "status", "")) or STATUS_CLIENT_RAISED,
        send_ts=send_ts, end_ts=end_ts, e2e_ms=(end_ts - send_ts) * 1000,
        http_status=http if isinstance(http, int) and not isinstance(http, bool) else None,
        error=text(getattr(result, "error", None)) or None, reasoning=text(getattr(result, "reasoning", "")),
        content=text(getattr(result, "content", "")), findings=findings, valid=False, failed_layers=["client"],
        primary_layer="client", stream=bool(turn.settings.get("stream", True)), path=_path(path, number))


def _handed(ctx: RunContext, attempt: Attempt, sink: Callable[[Attempt], Any]) -> None:
    sink(attempt)
    if harness_error.is_unjudged(attempt.findings):
        ctx.on_unjudged(attempt)


@dataclass(frozen=True)
class _Chain:
    """What every attempt of one request shares: its id, conversation, control pair and where records go."""

    chain_id: str
    session_id: str | None
    control: tuple[int, str] | None
    sink: Callable[[Attempt], Any]


def _recorded(ctx: RunContext, scenario: Scenario, turn: Turn, prepared: PreparedRequest, judged: Judged,
              chain: _Chain, number: int, will_retry: bool, path: AttemptPath, drill: bool = False,
              intended_ts: float | None = None) -> Attempt:
    attempt = record_of(ctx, scenario, turn, prepared, judged, chain.chain_id, number, will_retry, path)
    attempt.drill, attempt.session_id, attempt.intended_send_ts = drill, chain.session_id, intended_ts
    if chain.control is not None:
        attempt.control_pair, attempt.control_role = chain.control
    _handed(ctx, attempt, chain.sink)
    return attempt


def run_turn(client: Client, ctx: RunContext, scenario: Scenario, turn: Turn, salt: str,
             sink: Callable[[Attempt], Any], control: tuple[int, str] | None = None,
             session_id: str | None = None, intended_ts: float | None = None, body: Body | None = None
             ) -> list[Attempt]:
    """One request with its retries, then its fallback where the turn declares one and the retries were
    exhausted (the last one failed in a way `retry.when` retries: it is then recorded `will_retry`, since the
    fallback follows in the same chain); returns every attempt (already sent to `sink`). `control` is the
    (pair number, "cold" | "warm") of a prefix-cache control request; its retries keep both. An answer the
    harness could not judge ends the chain (a retry would answer nothing about the server). `body`: the
    request's bytes where the history is not the script's (k3load.workload.model_history)."""
    prepared = body(scenario, turn, salt) if body else \
        build_request(scenario, turn.index, ctx.model, salt, ctx.long_context(scenario))
    policy, chain = turn.retry, _Chain(uuid.uuid4().hex, session_id, control, sink)
    attempts: list[Attempt] = []
    for number in range(1, policy["max_attempts"] + 1):
        short = drill_deadline_s(policy, number)
        judged = send_and_judge(client, ctx, scenario, turn, prepared.body,
                                turn.settings["timeout_s"] if short is None else short, session_id)
        reason = None if judged.fault else retry_reason(judged.result, judged.findings)
        will_retry = reason in policy["when"] and (number < policy["max_attempts"] or turn.fallback is not None)
        attempts.append(_recorded(ctx, scenario, turn, prepared, judged, chain, number, will_retry,
                                  AttemptPath.FIRST_TRY if number == 1 else AttemptPath.RETRY, short is not None,
                                  intended_ts if number == 1 else None))
        if not attempts[-1].will_retry:  # a record that could not be built says False: the chain ends
            return attempts
        ctx.sleep(retry_wait_s(policy, turn.settings["timeout_s"], judged.result))
    return [*attempts, _fallback(client, ctx, scenario, turn, prepared, chain, len(attempts) + 1)]


def _fallback(client: Client, ctx: RunContext, scenario: Scenario, turn: Turn, prepared: PreparedRequest,
              chain: _Chain, number: int) -> Attempt:
    """The one attempt after the exhausted retries: the same body with the turn's `fallback:` applied (nothing
    else changed), sent with the turn's own deadline, judged as `fallback_turn` says; never retried."""
    assert turn.fallback is not None  # run_turn retries its last attempt only where a fallback follows
    data = compact(fallback_body(json.loads(prepared.body), turn.fallback))
    sent = replace(prepared, body=data, sha256=sha256(data))
    judged_turn = fallback_turn(turn, turn.fallback)
    judged = send_and_judge(client, ctx, scenario, judged_turn, sent.body, judged_turn.settings["timeout_s"],
                            chain.session_id)
    return _recorded(ctx, scenario, judged_turn, sent, judged, chain, number, False, AttemptPath.FALLBACK)


def _compared(stream: Judged, whole: Judged) -> None:
    """The streamed twin's `stream.equivalence` finding; where comparing raised, the streamed twin is the
    answer the harness could not judge."""
    try:
        stream.findings.append(compare_twins(stream.result, stream.findings, whole.result, whole.findings))
    except Exception as exc:
        stream.fault = HarnessFault.of(exc, harness_error.PHASE_COMPARE)
        stream.findings = [harness_error.finding(stream.fault, stream.result)]


def run_turn_both_ways(client: Client, ctx: RunContext, scenario: Scenario, turn: Turn, salt: str,
                       sink: Callable[[Attempt], Any], session_id: str | None = None,
                       intended_ts: float | None = None, body: Body | None = None) -> list[Attempt]:
    """The streaming-equivalence drill: the turn sent streamed (the bytes it always sends) and whole
    (the same body with `stream: false`; a logged body also without its `stream_options`) at once, one
    attempt each, no retries (the first answers are compared). The streamed attempt carries the comparison
    as its `stream.equivalence` finding, so both are recorded when the later one ends."""
    logged_whole = None if turn.request is None else \
        {k: False if k == "stream" else v for k, v in turn.request.items() if k != "stream_options"}
    whole_turn = replace(turn, settings={**turn.settings, "stream": False}, request=logged_whole)
    whole_scenario = replace(scenario, turns=tuple(whole_turn if t.index == turn.index else t
                                                   for t in scenario.turns))
    context = ctx.long_context(scenario)
    build = body or (lambda s, t, salt_: build_request(s, t.index, ctx.model, salt_, context))
    streamed, whole = build(scenario, turn, salt), build(whole_scenario, whole_turn, salt)
    assert ctx.drill is not None
    s_judged, w_judged = ctx.drill.concurrently(
        lambda: send_and_judge(client, ctx, scenario, turn, streamed.body, turn.settings["timeout_s"], session_id),
        lambda: send_and_judge(client, ctx, whole_scenario, whole_turn, whole.body, turn.settings["timeout_s"],
                               session_id))
    _compared(s_judged, w_judged)
    pair = uuid.uuid4().hex
    attempts = [record_of(ctx, scenario, turn, streamed, s_judged, uuid.uuid4().hex, 1, False),
                record_of(ctx, whole_scenario, whole_turn, whole, w_judged, uuid.uuid4().hex, 1, False)]
    for attempt, role in zip(attempts, ("stream", "whole"), strict=True):
        attempt.stream_pair, attempt.stream_role, attempt.session_id = pair, role, session_id
        attempt.intended_send_ts = intended_ts
        _handed(ctx, attempt, sink)
    return attempts


class ScenarioPlay:
    """One playing of a scenario, a turn at a time (so a Locust user can stop between turns).

    Conversations go on after a failed turn: the history is scripted, so later turns are still
    meaningful and their results still count (under `history: model` the model's answers make it, one
    request a step: k3load.workload.model_history). A `pair` scenario plays each turn as a control pair in
    one step (cold with a fresh salt, then its warm twin, the same bytes, once the cold one ended), so
    a stage change never separates a warm request from its cold twin."""

    def __init__(self, client: Client, ctx: RunContext, scenario: Scenario, arrival_ts: float | None = None,
                 pace: random.Random | None = None) -> None:
        """`arrival_ts` and `pace`: an open-loop session (k3load.loadgen.arrivals) that arrived then, and
        the draws of its agent's gaps between turns (k3load.workload.think_time); None: closed-loop, each
        turn sent when the last one ended."""
        self.client, self.ctx, self.scenario = client, ctx, scenario
        self.next_turn = 0
        self._salt = ctx.salt(scenario) if scenario.prefix_salt != "request" else ""
        self.session_id = f"k3load-{uuid.uuid4().hex}"  # sent only under ctx.session_header
        self.intended_ts, self._pace = arrival_ts, pace  # when the next turn is meant to go (None: now)
        self._model = model_history.ModelHistory(scenario, ctx.model, ctx.long_context(scenario)) \
            if model_history.drives(scenario) else None

    @property
    def done(self) -> bool:
        return self._model.done if self._model else self.next_turn >= len(self.scenario.turns)

    def due_in_s(self, now: float) -> float:
        """Seconds until the next turn is meant to go (0 or less: due)."""
        return 0.0 if self.intended_ts is None else self.intended_ts - now

    def step(self, sink: Callable[[Attempt], Any]) -> list[Attempt]:
        if self._model:
            attempts = self._model.step(self._send, sink, self.intended_ts)
        else:
            self.next_turn += 1
            attempts = self._send(self.scenario.turns[self.next_turn - 1], model_history.scripted_sink(sink),
                                  self.intended_ts)
        if self._pace is not None and not self.done:  # the agent's gap: its tools run, its user reads and types
            end = max((a.end_ts for a in attempts), default=time.time())
            self.intended_ts = end + (self._model.gap_s(self._pace) if self._model else
                                      gap_before(self.scenario, self.next_turn, self._pace))
        return attempts

    def _send(self, turn: Turn, sink: Callable[[Attempt], Any], intended: float | None,
              body: Body | None = None) -> list[Attempt]:
        if self.scenario.prefix_salt == "pair":
            return self._pair(turn, sink, intended)
        salt = self.ctx.salt(self.scenario) if self.scenario.prefix_salt == "request" else self._salt
        if self.ctx.drill is not None and self.ctx.drill.chooses(self.scenario, turn):
            return run_turn_both_ways(self.client, self.ctx, self.scenario, turn, salt, sink, self.session_id,
                                      intended, body)
        return run_turn(self.client, self.ctx, self.scenario, turn, salt, sink, session_id=self.session_id,
                        intended_ts=intended, body=body)

    def _pair(self, turn: Turn, sink: Callable[[Attempt], Any], intended: float | None) -> list[Attempt]:
        """Cold then warm, sequentially: the warm twin can only hit what the cold one left cached.
        The warm one is sent whatever the cold one's outcome (the analysis judges the pair)."""
        number, salt = self.ctx.next_pair()
        cold = run_turn(self.client, self.ctx, self.scenario, turn, salt, sink, (number, "cold"), self.session_id,
                        intended)
        warm = run_turn(self.client, self.ctx, self.scenario, turn, salt, sink, (number, "warm"), self.session_id)
        return cold + warm


def run_scenario(client: Client, ctx: RunContext, scenario: Scenario, sink: Callable[[Attempt], Any]
                 ) -> list[Attempt]:
    """Every turn of a scenario, in order."""
    play = ScenarioPlay(client, ctx, scenario)
    attempts: list[Attempt] = []
    while not play.done:
        attempts += play.step(sink)
    return attempts
