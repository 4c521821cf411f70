"""A `kind: replay` stage: a production trace (k3load.workload.trace) played open-loop at its own pace.

Row i is due at the stage's entry + (timestamp_i - timestamp_0) / 1000 / speed, whatever the server does (as
an `arrival` stage's sessions, k3load.loadgen.arrivals). The stage's `users` are the most requests in flight:
each user takes the next row, waits for its time and sends it; a row whose time came while every user was busy
goes out late, and its record keeps the intended time beside the send (`intended_send_ts`), so the analysis
counts it (analysis/pillars/headroom/arrival_lag.py: late_turns, send_lag_*). Rows not reached by the stage's end are
counted as
not played, never dropped unseen. Each row is one chat completion through the harness's client (its record,
validation with expect `any`, no retry: the trace's requests are offered once), its prompt built from the row's
hash_ids (k3load.workload.trace_prompts), `max_tokens` and `min_tokens` both the row's output_length (vLLM's
SamplingParams honours min_tokens, so the answer is as long as production's); a row longer than the server's
max_model_len is cut to fit (its leading blocks kept) and counted.

With --processes N each worker plays the rows whose index mod N is its worker index (Locust's), with its own
share of the users; remote workers split them by the master's worker count, sent with each stage
(`process_share`). A worker that cannot know the count plays every row only as worker 0, the others none, so
the trace is never offered twice.

At the stage's end each process writes `replay_end` (events.jsonl; a worker sends it to its master): rows due,
sent, late, not played, cut, the worst lag, how many were in flight at most, the tokenizer that sized the
blocks, and, when rows went out late, which generator fell behind and why (`fell_behind`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
import gevent.lock
import httpx

from k3load.analysis.pillars.headroom.arrival_lag import LATE_S
from k3load.events import FIELDS, Event, Message
from k3load.loadgen.role import ProcessRole
from k3load.loadgen.target import TargetApi
from k3load.records import Attempt
from k3load.rundir import JsonlLog
from k3load.workload.conversation import RunContext, record_of, send_and_judge
from k3load.workload.plan import ReplaySpec, Stage
from k3load.workload.scenario import Scenario, Turn
from k3load.workload.stored_requests import PreparedRequest
from k3load.workload.trace import TraceRow, read_trace_once
from k3load.workload.trace_prompts import BlockTexts

log = logging.getLogger("k3load")
FAMILY = "replay"  # the records' family: a trace's requests are no scenario family's
TIMEOUT_S = 300.0  # one row's deadline, stream included
TEMPLATE_MARGIN = 64  # tokens the chat template adds around the prompt, kept free when a row is cut to fit


@dataclass(frozen=True)
class Share:
    """Which rows this process plays: index mod `of` == `index`; `why` when it plays none or all for a reason."""

    index: int = 0
    of: int = 1
    why: str = ""


def process_share(runner: Any, options: Any, workers: int | None = None) -> Share:
    """Locust's worker index and --processes (or the master's worker count, sent with the stage: remote workers
    are not told it otherwise): this worker's rows; a local runner (or the master) plays all. A worker whose
    index is past the count (it joined after the stage began) plays none, and says so: a row is never sent twice."""
    index = getattr(runner, "worker_index", None)
    if not ProcessRole.of(runner).is_worker or index is None or index < 0:
        return Share()
    processes = int(getattr(options, "processes", 0) or 0)
    if processes > index:
        return Share(index, processes)
    if workers:
        if index < workers:
            return Share(index, workers, f"{workers} workers (the master's count at the stage's entry)")
        return Share(index, 1, f"plays no row: worker index {index} is past the master's {workers} workers")
    if index == 0:
        return Share(0, 1, "worker count unknown (no --processes, none from the master): worker 0 plays every row")
    return Share(index, 1, "worker count unknown (no --processes, none from the master): only worker 0 plays "
                           "the trace")


def fitted(row: TraceRow, max_model_len: int | None) -> tuple[int, int, bool]:
    """(input tokens, output tokens, cut): the row within the server's context, its leading blocks kept."""
    inp, out = row.input_length, row.output_length
    if not max_model_len or inp + out + TEMPLATE_MARGIN <= max_model_len:
        return inp, out, False
    out = min(out, max(1, max_model_len // 4))
    return max(1, min(inp, max_model_len - TEMPLATE_MARGIN - out)), out, True


def body(model: str, prompt: str, output_tokens: int, min_tokens: bool = True) -> bytes:
    """The chat completion a row sends: its prompt as one user message, its answer exactly output_tokens long
    where the server honours min_tokens (vLLM does; `min_tokens` False once the server refused it), streamed
    with usage."""
    floor = {"min_tokens": output_tokens} if min_tokens else {}
    return json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": output_tokens, **floor, "stream": True,
                       "stream_options": {"include_usage": True}},
                      separators=(",", ":"), ensure_ascii=False).encode()


def refuses_min_tokens(judged: Any) -> bool:
    """A 400 that names min_tokens: a server (or a gateway before it) that does not take vLLM's parameter."""
    result = judged.result
    return result.http_status == 400 and "min_tokens" in (result.error_body or result.error or "")


@dataclass
class Ticket:
    index: int  # the row's place in the trace, 0-based
    row: TraceRow
    due_ts: float


@dataclass
class ReplayState:
    """One replay stage in one process: its rows' schedule and what became of them."""

    stage: Stage
    spec: ReplaySpec
    share: Share
    tickets: list[Ticket]
    not_played: int  # this process's rows due after the stage's end
    end_ts: float
    texts: BlockTexts
    max_model_len: int | None
    next: int = 0
    in_flight: int = 0
    in_flight_max: int = 0
    sent: int = 0
    late: int = 0
    late_all_busy: int = 0
    worst_lag_s: float = 0.0
    cut: int = 0
    min_tokens: bool = True  # sent while the server takes it; a 400 naming it turns it off for the later rows
    # answered rows whose answer came back shorter than the row asked: a server (or a gateway that drops unknown
    # parameters) that did not honour min_tokens offers less decode than the trace did, said at the stage's end
    rows_short: int = 0
    written: bool = False
    scenario: Scenario = field(init=False)

    def __post_init__(self) -> None:
        turn = Turn(index=0, expect={"kind": "any"}, settings={"max_tokens": None, "stream": True,
                                                                "timeout_s": TIMEOUT_S, "retry": {"max_attempts": 1}})
        self.scenario = Scenario(name=f"trace:{Path(self.spec.trace).name}", family=FAMILY, system_prompt="",
                                 turns=(turn,), path=Path(self.spec.trace))

    def take(self, now: float, free_since: float) -> Ticket | None:
        """The next row for a user free since `free_since` (its time may be past: it goes late), None when none
        is left. Users take rows in order the moment they are free, so a row taken late by a user that was still
        sending at its time was due while every user was busy; one taken late by a user free before its time
        waited on this process itself (its CPU, its event loop)."""
        if self.next >= len(self.tickets):
            return None
        ticket = self.tickets[self.next]
        self.next += 1
        if now - ticket.due_ts > LATE_S and free_since > ticket.due_ts:
            self.late_all_busy += 1
        return ticket

    def play(self, ticket: Ticket, client: Any, ctx: RunContext, sink: Callable[[Attempt], Any], model: str) -> None:
        """Send one row and record it (the record keeps its intended time and the row as its session)."""
        inp, out, cut = fitted(ticket.row, self.max_model_len)
        self.cut += cut
        prompt = self.texts.prompt(ticket.row.hash_ids, inp)
        raw = body(model, prompt, out, self.min_tokens)
        turn = Turn(index=ticket.index, expect={"kind": "any"},
                    settings={"max_tokens": out, "stream": True, "timeout_s": TIMEOUT_S,
                              "retry": {"max_attempts": 1}})
        head = self.texts.text(ticket.row.hash_ids[0], min(inp, self.texts.block_tokens))
        prepared = PreparedRequest(self.scenario.name, ticket.index, raw, hashlib.sha256(raw).hexdigest(),
                                   hashlib.sha256(head.encode()).hexdigest())
        session_id = f"k3load-trace-row-{ticket.index}"
        # counted as it goes out, not when its answer ends: a row still streaming at the stage's end was sent
        # (its record comes when it ends), never "not played" (found in review)
        lag = time.time() - ticket.due_ts
        self.sent += 1
        self.worst_lag_s = max(self.worst_lag_s, lag)
        self.late += lag > LATE_S
        self.in_flight += 1
        self.in_flight_max = max(self.in_flight_max, self.in_flight)
        try:
            judged = send_and_judge(client, ctx, self.scenario, turn, raw, TIMEOUT_S, session_id)
        finally:
            self.in_flight -= 1
        if self.min_tokens and refuses_min_tokens(judged):
            self.min_tokens = False
            log.warning("k3load: replay %s: the server refused min_tokens (HTTP 400): later rows ask max_tokens "
                        "only, their answers may end sooner than the trace's output_length", self.stage.name)
        done = judged.result.completion_tokens
        self.rows_short += judged.result.status == "ok" and done is not None and done < out
        attempt = record_of(ctx, self.scenario, turn, prepared, judged, judged.attempt_id, 1, False)
        attempt.session_id, attempt.intended_send_ts = session_id, ticket.due_ts
        sink(attempt)

    def release(self) -> None:
        """The stage ended and its summary is said: the rows not taken are not played (a user asking now gets none)
        and the block texts are let go, so a run of many replay stages keeps no ended stage's schedule or texts
        (a row taken before the end and sent after it makes its texts again, the same)."""
        self.tickets, self.next = [], 0
        self.texts.forget()

    def summary(self) -> dict[str, Any]:
        """What became of this process's rows, and who fell behind when rows went late."""
        due = len(self.tickets) + self.not_played
        out = {"stage": self.stage.name, "trace": self.spec.trace, "speed": self.spec.speed,
               "block_tokens": self.spec.block_tokens, "max_rows": self.spec.max_rows,
               "share": f"{self.share.index} of {self.share.of}", "share_note": self.share.why or None,
               "rows_due": due, "rows_sent": self.sent, "rows_late": self.late,
               "rows_not_played": due - self.sent, "rows_in_flight_at_end": self.in_flight, "rows_cut": self.cut,
               "worst_lag_s": round(self.worst_lag_s, 3), "min_tokens": self.min_tokens,
               "rows_short": self.rows_short,
               "users": self.stage.users, "in_flight_max": self.in_flight_max, **self.texts.fit.as_dict()}
        out["fell_behind"] = fell_behind(out, self.late_all_busy)
        return out


def fell_behind(summary: dict[str, Any], all_busy: int) -> str | None:
    """The generator that fell behind, named, or None when no row went out late."""
    late, sent = summary["rows_late"], summary["rows_sent"]
    if not late:
        return None
    said = (f"trace replay fell behind (process {summary['share']}): {late} of {sent} rows sent over {LATE_S:g} s "
            f"late, worst {summary['worst_lag_s']:.1f} s")
    if all_busy:
        return (f"{said}; {all_busy} of them were due while all {summary['users']} users (the stage's most requests "
                "in flight) were busy: the server answered slower than the trace arrived, or users is too low")
    return f"{said} while users were free: this load-generator process could not keep up (its CPU)"


class Replays:
    """Each replay stage's state in this process, made when its first user asks, afresh each run."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._by_stage: dict[str, ReplayState] = {}
        self._making = gevent.lock.Semaphore()  # sizing the blocks calls the server: the other users wait for it

    def of(self, stage: Stage, entered_ts: float, share: Share, count: Callable[[str], int] | None,
           max_model_len: int | None, write: Callable[[dict[str, Any]], None]) -> ReplayState:
        with self._making:
            found = self._by_stage.get(stage.name)
            if found is None:
                found = self._by_stage[stage.name] = start(stage, entered_ts, share, count, max_model_len)
                gevent.spawn_later(max(found.end_ts - time.time(), 0.0), finish, found, write)
        return found


def start(stage: Stage, entered_ts: float, share: Share, count: Callable[[str], int] | None,
          max_model_len: int | None) -> ReplayState:
    """The stage's schedule for this process's share of the rows, and its blocks sized (bounded /tokenize calls)."""
    spec = ReplaySpec.of(stage.replay)
    assert spec is not None
    rows = read_trace_once(Path(spec.trace), spec.block_tokens, spec.max_rows)  # parsed when the plan loaded
    first, end_ts = rows[0].timestamp_ms, entered_ts + stage.duration_s
    mine = [Ticket(i, row, entered_ts + (row.timestamp_ms - first) / 1000.0 / spec.speed)
            for i, row in enumerate(rows) if i % share.of == share.index]
    if share.of == 1 and share.index > 0:
        mine = []  # a remote worker that cannot know its share: only worker 0 plays
    tickets = [t for t in mine if t.due_ts < end_ts]
    sample = list(dict.fromkeys(h for t in tickets[:64] for h in t.row.hash_ids))
    texts = BlockTexts(spec.block_tokens, count, sample)
    return ReplayState(stage, spec, share, tickets, len(mine) - len(tickets), end_ts, texts, max_model_len)


def finish(state: ReplayState, write: Callable[[dict[str, Any]], None]) -> None:
    """At the stage's end: the summary, once (rows still untaken then were not played)."""
    if state.written:
        return
    state.written = True
    summary = state.summary()
    if summary["fell_behind"]:
        log.warning("k3load: %s", summary["fell_behind"])
    if summary["rows_short"]:
        log.warning("k3load: replay %s: %d answered rows came back shorter than their output_length: the server (or "
                    "a gateway before it) did not honour min_tokens, so this stage decoded less than the trace did",
                    state.stage.name, summary["rows_short"])
    state.release()
    with contextlib.suppress(ValueError):  # the run's logs closed first: nowhere to write it
        write(summary)


def server_count(target: TargetApi, model: str) -> Callable[[str], int]:
    """The target's own token count of a text (`/tokenize` with `prompt`, as vLLM and the sim serve it), with the
    run's key, headers and TLS; raises ValueError when the server cannot say (the blocks are then estimated)."""
    def count(text: str) -> int:
        try:
            with target.client() as client:
                resp = client.post(target.url("/tokenize"), json={"model": model, "prompt": text})
            resp.raise_for_status()
            return int(resp.json()["count"])
        except (httpx.HTTPError, KeyError, TypeError) as exc:
            raise ValueError(f"/tokenize: {type(exc).__name__}") from None
    return count


def event_writer(events: JsonlLog | None, runner: Any, run_id: str) -> Callable[[dict[str, Any]], None]:
    """Master/local (`events`, the run's): into events.jsonl as `replay_end`; a worker (no events) sends it to its
    master (Message.REPLAY), which writes it there (`write_from_worker`), and logs it too."""
    def write(summary: dict[str, Any]) -> None:
        if events is not None:
            events.event(Event.REPLAY_END, **summary)
            return
        log.info("k3load: replay_end %s", json.dumps(summary))
        if ProcessRole.of(runner).is_worker:
            try:
                runner.send_message(Message.REPLAY, {"run_id": run_id, **summary})
            except Exception as exc:  # the master is gone: the log line above is what is left
                log.warning("k3load: replay_end not sent to the master: %s", exc)
    return write


def write_from_worker(events: JsonlLog | None, worker: str, data: dict[str, Any]) -> None:
    """Master: a worker's `replay_end` into events.jsonl (the analysis sums a stage's, one per process). Only the
    event's declared fields: the worker port takes any peer (the master does not authenticate workers), and a
    message must not write keys of its own choosing into the evidence."""
    if events is None or not isinstance(data, dict):
        return
    fields = {k: v for k, v in data.items() if k in FIELDS[Event.REPLAY_END]}
    with contextlib.suppress(ValueError):  # the run's logs closed first: nowhere to write it
        events.event(Event.REPLAY_END, **fields)
