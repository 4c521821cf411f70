"""`history: model`: the history of one playing of a scenario, built from what the model answered.

    history = ModelHistory(scenario, "kimi-k3", long_context=None)
    while not history.done:
        attempts = history.step(send, sink, intended_ts)   # send: ScenarioPlay._send (one request, its retries)

Why: a scripted history proves the same bytes run after run, but it never shows what production sees: the
model's own calls, executed and fed back, the context growing with its own answers, the extra rounds an
agent runs until the model stops calling tools. Under `history: model` the model steers: after each answer
the history holds that answer (its content, its calls as the server returned them: ids, names, arguments
text) and a tool message per call, whose content is the scenario's executor for that tool (a scripted
scenario's deterministic table; a logged scenario's recorded results, written by `k3load import`), the
executor's `default` for arguments that are not a JSON object, and NO_RESULT, clearly ours, where no
executor exists (counted: `Attempt.unanswered_calls`). Then comes what the next scripted turn adds: a
scripted turn's `user` message, a logged turn's logged messages minus the logged answer and the logged
results of its calls (those are replaced by the model's own).

Like a real agent, bounded: an answer with calls whose next scripted turn brings a user message (or that
ends the script) is fed back first, in extra rounds of the same turn (`model_round` 1, 2, ...; same
settings; `turn` stays the scripted turn's index) until the model answers without calls, at most
MAX_MODEL_ROUNDS per turn and MAX_SESSION_ROUNDS per playing (`rounds_capped`: the conversation moved on
with the calls' results in the history, unanswered). An answer without calls where the script's next turns
only carry tool results leaves them nothing to send: they are skipped (`skipped_turns`). So a playing sends
at most len(turns) + MAX_SESSION_ROUNDS requests, each bounded by its turn's timeout and retry policy.

Judged on what the model did: while the history is on script a turn keeps its expectation; from the turn
after the conversation left the script (`off_script_turn`: the model called other tools, other arguments
as JSON values, or called where the script answered or the reverse; or an extra round the script does not
have), and in every extra round, the turn is judged by its relaxed copy (`relaxed`): validity alone.

An attempt that brought no answer (a transport failure, a timeout, an answer the harness could not judge)
leaves the script's answer for that turn in the history (its reply and results, or the logged messages as
logged), so the conversation goes on as `history: scripted` would have gone on. Control pairs
(`prefix_salt: pair`: the twins must be byte-identical) and independent scenarios (no history) are always
played scripted (`drives`).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from k3load.client.result import STATUS_OK
from k3load.records import Attempt
from k3load.workload import harness_error, logged, strict_json
from k3load.workload.scenario import Scenario, Turn, execute_tool
from k3load.workload.stored_requests import PreparedRequest, fixed_messages, prepared_with_history, replay_turn
from k3load.workload.think_time import DEFAULT_USER_THINK, Duration, tool_time

MAX_MODEL_ROUNDS = 3  # extra rounds of one scripted turn (results fed back until the model answers)
MAX_SESSION_ROUNDS = 12  # extra rounds of one playing, all turns together
NO_RESULT = json.dumps({"error": "k3load: no recorded or scripted result for this call"})
SCRIPTED, MODEL = "scripted", "model"

Body = Callable[[Scenario, Turn, str], PreparedRequest]  # (scenario, turn as sent, salt) -> the request's bytes
Sink = Callable[[Attempt], Any]


def drives(scenario: Scenario) -> bool:
    """Whether the model drives this playing: `history: model` on a conversation or a logged scenario,
    never on a control pair (its warm twin must repeat the cold one's bytes)."""
    return scenario.history == MODEL and scenario.prefix_salt != "pair" and \
        (scenario.mode == "conversation" or scenario.is_logged)


def scripted_sink(sink: Sink) -> Sink:
    """`sink` with each record marked `history: scripted`."""
    def marked(attempt: Attempt) -> Any:
        attempt.history = SCRIPTED
        return sink(attempt)
    return marked


def relaxed(scenario: Scenario, turn: Turn) -> Turn:
    """The turn judged on validity alone: the protocol, separation and tool-call checks (calls name offered
    tools, arguments valid against their schema) stay; which tool, or calling versus answering, no longer
    counts. Structured output stays checked (kind json) where the turn asks for it with a response_format
    and cannot call a tool (tool_choice none, or no tools offered): a call there would otherwise read as
    content that is not JSON."""
    fmt = turn.settings.get("response_format")
    offered = logged.request_tools(turn.request) if scenario.is_logged else scenario.tools
    structured = isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object") and \
        (turn.settings.get("tool_choice") == "none" or not offered)
    if structured:
        return turn if turn.kind == "json" else replace(turn, expect={"kind": "json"})
    return turn if turn.kind == "any" else replace(turn, expect={"kind": "any"})


def added(scenario: Scenario, turn: Turn) -> list[dict[str, Any]]:
    """What a scripted turn adds to the history before its request besides the previous answer: its user
    message; a logged turn, its logged messages but the answer the agent got back (the leading assistant
    and tool messages) and the logged results of that answer's calls. The first logged turn adds them all."""
    if not scenario.is_logged:
        return [] if turn.user is None else [{"role": "user", "content": turn.user}]
    messages = [dict(m) for m in turn.messages]
    if turn.index == 0:
        return messages
    lead, answered = 0, set()
    while lead < len(messages) and messages[lead].get("role") in ("assistant", "tool"):
        answered |= {c.get("id") for c in messages[lead].get("tool_calls") or [] if isinstance(c, dict)}
        lead += 1
    return [m for m in messages[lead:] if not (m.get("role") == "tool" and m.get("tool_call_id") in answered)]


def _call_key(name: Any, arguments: Any) -> tuple[str, str]:
    """A call compared as its name and its arguments as a JSON value (key order and spacing aside)."""
    value = strict_json.loads_or_none(arguments) if isinstance(arguments, str) else arguments
    if isinstance(arguments, str) and value is None and arguments.strip() != "null":
        return str(name), "\0" + arguments  # not JSON: compared as text
    return str(name), json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)  # YAML dates as text


def on_script(scenario: Scenario, turn: Turn, attempt: Attempt) -> bool:
    """The model did what the script says this turn's answer was (its `reply`, or the logged answer): the
    same calls (names and arguments, in any order), or an answer where the script answered. A turn whose
    answer the script does not know (the last scripted turn, an unrecorded logged one) cannot leave it."""
    script = turn.recorded if scenario.is_logged else turn.reply
    if script is None:
        return True
    want = sorted(_call_key(c.get("name"), c.get("arguments")) for c in script.get("tool_calls") or [])
    got = sorted(_call_key(_function(c).get("name"), _function(c).get("arguments")) for c in attempt.tool_calls)
    return want == got


def _function(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    return function if isinstance(function, dict) else {}


@dataclass
class Ask:
    """The next request of a model-driven playing: its turn as judged, its round, the messages it adds to the
    history (taken into it with its answer) and its bytes for a salt (`Body`)."""

    turn: Turn
    model_round: int
    new: list[dict[str, Any]]
    body: Body = field(repr=False)
    taken: bool = False


class ModelHistory:
    """The model-driven history of one playing (see the module docstring); `tail` is every message after
    the fixed head (system prompt, context, long input: rebuilt per request, since a salt may change it)."""

    def __init__(self, scenario: Scenario, model: str, long_context: str | None = None) -> None:
        self.scenario, self.model, self.long_context = scenario, model, long_context
        self.tail: list[dict[str, Any]] = []
        self.turn_index, self.model_round, self.done = 0, 0, False
        self.off_script_turn: int | None = None
        self.extra_rounds = self.skipped_turns = self.unanswered_calls = self.capped = 0  # over the playing
        self._new = added(scenario, scenario.turns[0])
        self._last_calls: list[str] = []

    def step(self, send: Callable[[Turn, Sink, float | None, Body], list[Attempt]], sink: Sink,
             intended_ts: float | None) -> list[Attempt]:
        """Send the next request through `send` (the play's own sender: drill, retries, records); the
        history moves on when its final answer is recorded, or without an answer if none was."""
        ask = self.next_ask()
        try:
            return send(ask.turn, self.recorder(ask, sink), intended_ts, ask.body)
        finally:
            if not ask.taken:
                self.take(ask, None)

    def next_ask(self) -> Ask:
        """The next request: the turn keeps its expectation while on script, in its first round."""
        assert not self.done, "the playing is over"
        turn = self.scenario.turns[self.turn_index]
        keeps = self.model_round == 0 and self.off_script_turn is None
        history = [*self.tail, *self._new]

        def body(scenario: Scenario, sent: Turn, salt: str) -> PreparedRequest:
            head = [] if scenario.is_logged else fixed_messages(scenario, salt, self.long_context)
            return prepared_with_history(scenario, sent, self.model, head + history, salt, self.long_context)

        return Ask(turn if keeps else relaxed(self.scenario, turn), self.model_round, self._new, body)

    def recorder(self, ask: Ask, sink: Sink) -> Sink:
        """`sink` with each record marked (history, round, off-script turn), the request's final answer
        (its last attempt; the streamed twin of a drill) taken into the history before it is written."""
        def record(attempt: Attempt) -> Any:
            attempt.history, attempt.model_round = MODEL, ask.model_round
            if not attempt.will_retry and attempt.stream_role != "whole" and not ask.taken:
                self.take(ask, attempt)
            attempt.off_script_turn = self.off_script_turn
            return sink(attempt)
        return record

    def take(self, ask: Ask, attempt: Attempt | None) -> None:
        """The history after `ask`'s request: its own messages, then the model's answer and its results
        (or, without an answer, the script's), and what is sent next."""
        ask.taken = True
        self.tail += ask.new
        turn = self.scenario.turns[self.turn_index]
        if attempt is None or attempt.status != STATUS_OK or harness_error.is_unjudged(attempt.findings):
            self._last_calls = []
            if ask.model_round == 0:
                self._scripted_answer(turn)
            self._to_turn(self.turn_index + 1, as_logged=ask.model_round == 0)
            return
        if ask.model_round == 0 and self.off_script_turn is None and not on_script(self.scenario, turn, attempt):
            self.off_script_turn = turn.index
        self._answer(attempt)
        self._after(turn, attempt)

    def _after(self, turn: Turn, attempt: Attempt) -> None:
        """What follows an answer: the next scripted turn that adds something (turns that only carried the
        results of calls the model did not make are skipped); after calls, the next turn when it carries
        their results, else an extra round while the caps allow."""
        following = turn.index + 1
        moot = [] if attempt.tool_calls else \
            list(itertools.takewhile(lambda t: not added(self.scenario, t), self.scenario.turns[following:]))
        if not attempt.tool_calls:
            attempt.skipped_turns = len(moot)
            self.skipped_turns += len(moot)
            if moot and self.off_script_turn is None:  # a request the script has is not sent
                self.off_script_turn = turn.index
            self._to_turn(following + len(moot))
        elif following < len(self.scenario.turns) and not added(self.scenario, self.scenario.turns[following]):
            self._to_turn(following)  # the next turn carries the results of the model's calls
        elif self.model_round < MAX_MODEL_ROUNDS and self.extra_rounds < MAX_SESSION_ROUNDS:
            self.model_round += 1
            self.extra_rounds += 1
            self._new = []
            if self.off_script_turn is None:  # a round the script does not have
                self.off_script_turn = turn.index
        else:
            attempt.rounds_capped = True
            self.capped += 1
            self._to_turn(following)

    def _answer(self, attempt: Attempt) -> None:
        """The model's answer as the next request sends it back, then one tool message per call."""
        calls: list[dict[str, Any]] = []
        self._last_calls = []
        before = sum(len(m.get("tool_calls") or []) for m in [*self.scenario.context, *self.tail]
                     if m.get("role") == "assistant")
        for i, call in enumerate(attempt.tool_calls):
            function = _function(call)
            name, arguments = function.get("name"), function.get("arguments")
            wire_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else \
                f"functions.{name}:{before + i}"  # the server gave none: Kimi's form, as the script writes
            calls.append({"id": wire_id, "type": "function",
                          "function": {"name": str(name or ""), "arguments": arguments if isinstance(arguments, str)
                                       else ""}})
        if not calls:
            self.tail.append({"role": "assistant", "content": attempt.content})
            return
        self.tail.append({"role": "assistant", "content": attempt.content or None, "tool_calls": calls})
        missing = 0
        for call in calls:
            content, found = self._result(call["function"]["name"], call["function"]["arguments"])
            missing += not found
            self.tail.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        attempt.unanswered_calls = missing
        self.unanswered_calls += missing
        self._last_calls = [c["function"]["name"] for c in calls]

    def _result(self, name: str, arguments: str) -> tuple[Any, bool]:
        """The tool message's content for one call of the model, and whether an executor gave it: its row
        for these arguments (its default for arguments that are not a JSON object), else NO_RESULT. A logged
        result keeps its logged form (text, or a list of content parts)."""
        executor = self.scenario.executors.get(name)
        if executor is None:
            return NO_RESULT, False
        parsed = strict_json.loads_or_none(arguments)
        values = parsed if isinstance(parsed, dict) else None
        if self.scenario.is_logged:
            row = next((r for r in executor.get("table", []) if values is not None and
                        r["match"].items() <= values.items()), None)
            result = row["result"] if row is not None else executor["default"]
            if isinstance(result, str | list):
                return result, True
        return execute_tool(self.scenario, name, values), True  # values None (not an object): the default row

    def _scripted_answer(self, turn: Turn) -> None:
        """No answer came: the script's own for this turn (a scripted turn's reply and its results; a logged
        turn's come with the next turn's messages, sent as logged: `_to_turn(as_logged=True)`)."""
        if self.scenario.is_logged:
            return
        messages = [*self.scenario.context, *self.tail]
        count = len(messages)
        replay_turn(self.scenario, replace(turn, user=None), messages)
        self.tail += messages[count:]
        self._last_calls = [str(c.get("name")) for c in (turn.reply or {}).get("tool_calls") or []]

    def _to_turn(self, index: int, as_logged: bool = False) -> None:
        self.model_round = 0
        if index >= len(self.scenario.turns):
            self.done = True
            return
        self.turn_index = index
        turn = self.scenario.turns[index]
        self._new = [dict(m) for m in turn.messages] if as_logged and self.scenario.is_logged else \
            added(self.scenario, turn)

    def gap_s(self, rng: random.Random) -> float:
        """The agent's wait before the next request: its tools' run time after calls (parallel calls
        together: the longest), else its user's reading and typing (k3load.workload.think_time)."""
        if self._last_calls:
            return max(tool_time(self.scenario, name).draw(rng) for name in self._last_calls)
        return Duration.of(self.scenario.user_think_s, DEFAULT_USER_THINK).draw(rng)
