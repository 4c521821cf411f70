"""What the judgment keeps of one attempt record: the fields its rules read, nothing else.

Why not the whole `k3load.records.Attempt`: an hour at 100 requests/s is 360,000 records of about
1.8 KB each, and a dataclass per record holding its reasoning, content, tool-call arguments and every
finding took 2.8 GiB. `LeanAttempt` has the same attribute names and meanings as `Attempt` for the
fields it keeps (rules written against one read the other unchanged; the unit tests still hand them
real `Attempt`s), in slots, with the repeated values shared:

- `findings`: a tuple of shared `Finding`s, the same tuple for every record with the same findings
  (most records of a scenario turn fail nothing, and say so identically);
- `tool_calls`: the calls' function names only (`agreement.tool_names` reads a name from either shape),
  the arguments having been checked by the runner already (the findings say how they fared);
- `error_body`: kept only where the rules read it, on HTTP 400 (vLLM's context-length refusal);
- repeated strings (stage, scenario, status, layers, hashes, user ids) are one object each.

Dropped: the text (reasoning, content), the transport, the per-attempt inter-token percentiles and
decode time, which no rule reads (the stage table reads `itl_mean_ms` and `ttfa_ms` from `RunData.columns`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any

from k3load.analysis.run.answer_signature import answer_signature, compared
from k3load.records import Attempt, Finding
from k3load.workload.validate import primary_layer

REQUIRED = frozenset(f.name for f in fields(Attempt) if f.default is MISSING and f.default_factory is MISSING)


def _default(f: Field[Any]) -> Any:
    """A field's default, or a fresh value from its factory (every field outside REQUIRED has one)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise TypeError(f"Attempt.{f.name} has no default")  # never: REQUIRED holds those


DEFAULTS = {f.name: _default(f) for f in fields(Attempt) if f.name not in REQUIRED}


def derived_layer(findings: Sequence[Finding]) -> str | None:
    """The primary layer of a record written before the field, as the plain string a later record carries:
    the rule (`primary_layer`) gives a Layer member, and interned beside the strings read from records, a
    member would make the value's type depend on which line came first."""
    layer = primary_layer(list(findings))
    return None if layer is None else str(layer)


@dataclass(slots=True, eq=False)
class LeanAttempt:
    """One attempt as the rules read it (field meanings: `k3load.records.Attempt`)."""

    attempt_id: str
    chain_id: str
    attempt: int
    stage: str
    scenario: str
    family: str
    turn: int
    user_id: str
    request_sha256: str
    prefix_sha256: str
    status: str
    send_ts: float
    end_ts: float
    first_token_ts: float | None
    ttft_ms: float | None
    e2e_ms: float | None
    chunks: int
    prompt_tokens: int | None
    cached_tokens: int | None
    request_bytes: int | None
    finish_reason: str | None
    http_status: int | None
    error_body: str | None  # only on HTTP 400: the one body a rule reads (context-length refusals)
    tool_calls: tuple[str, ...]  # the calls' function names, in the answer's order
    findings: tuple[Finding, ...]
    valid: bool
    will_retry: bool
    drill: bool
    primary_layer: str | None
    control_pair: int | None
    control_role: str | None
    stream_pair: str | None
    stream_role: str | None
    tool_call_span_ms: float | None
    tool_call_max_gap_ms: float | None
    tool_call_deltas: int | None
    last_silence_ms: float | None
    temperature: float | None = None  # as sent; with `seed`, what makes a repeat a new draw (analysis/run/clusters.py)
    seed: int | None = None
    # how a streamed answer reached the client (analysis/pillars/headroom/buffering.py: a proxy's blocks)
    stream: bool = True
    stream_reads: int | None = None
    stream_bytes: int | None = None
    # a conversation the model drove (history: model): no designed body after its first request (reuse_replay.py)
    history: str | None = None
    model_round: int | None = None
    # what a tool-call or json turn's answer did, canonical (analysis/pillars/agent/reproducibility.py; None for other
    # turns)
    answer_signature: str | None = None
    # first_try, retry or fallback (k3load.workload.retry_policy.AttemptPath; None in older records)
    path: str | None = None


AnyAttempt = Attempt | LeanAttempt
# The counts and times the rules compute with (sums, ratios, comparisons): a value that is no plain number is
# read as unknown (None; `chunks` as its default 0), never handed to a rule that would fail on it.
NUMBERS = frozenset(("first_token_ts", "ttft_ms", "e2e_ms", "chunks", "prompt_tokens", "cached_tokens",
                     "request_bytes", "tool_call_span_ms", "tool_call_max_gap_ms", "tool_call_deltas",
                     "last_silence_ms", "stream_reads", "stream_bytes"))
PLAIN_INT = 2 ** 53  # integers a float holds exactly: a count past it is no count a server reported


def plain_number(value: Any, default: Any = None) -> Any:
    """`value` where it is a number a rule can compute with (a float, or an integer a float holds), else `default`."""
    kind = type(value)
    if kind is float or (kind is int and -PLAIN_INT <= value <= PLAIN_INT):
        return value
    return default
SHARED = ("stage", "scenario", "family", "user_id", "request_sha256", "prefix_sha256", "status", "finish_reason",
          "primary_layer", "control_role", "stream_role")


def designed_body(attempt: AnyAttempt) -> bool:
    """Whether the attempt sent its scenario's designed body (a model-driven conversation's bodies after its
    first request carry the model's own answers: no variant of the design is theirs)."""
    if getattr(attempt, "history", None) != "model":
        return True
    return attempt.turn == 0 and not getattr(attempt, "model_round", 0)


def by_findings(attempts: Iterable[AnyAttempt]) -> list[tuple[Sequence[Finding], list[AnyAttempt]]]:
    """The attempts grouped by their findings object, each group in attempt order, the groups in order of
    first appearance. Why: a lean attempt's findings are one tuple shared by every record that said the
    same (ten distinct ones over an hour's 360,000 records in bench/analysis_scale.py), so a rule reads
    each distinct list of findings once, not once per attempt. Whole Attempts (the unit tests') each hold
    their own list: one group each, the same answer."""
    groups: dict[int, tuple[Sequence[Finding], list[AnyAttempt]]] = {}
    for attempt in attempts:
        findings = attempt.findings
        group = groups.get(id(findings))  # every attempt is alive meanwhile: an id names one object
        if group is None:
            groups[id(findings)] = (findings, [attempt])
        else:
            group[1].append(attempt)
    return list(groups.values())


def first_finding(findings: Sequence[Finding], check: str) -> Finding | None:
    return next((f for f in findings if f.check == check), None)


def call_name(call: Any) -> str:
    """A tool call's function name, from a recorded call (a dict) or a lean record's name."""
    if isinstance(call, str):
        return call
    return str((call.get("function") or {}).get("name") or call.get("name") or "")


class Interner:
    """One object per distinct value across a run's records (strings, findings tuples, name tuples)."""

    def __init__(self) -> None:
        self.values: dict[Any, Any] = {}
        self.findings: dict[tuple[tuple[Any, ...], ...], tuple[Finding, ...]] = {}
        self.findings_text: dict[str | bytes, tuple[Finding, ...]] = {}  # a findings array's JSON -> its tuple

        self.intern = self.values.setdefault  # intern(v, v): the hot loops call the bound method directly

    def __call__(self, value: Any) -> Any:
        return self.values.setdefault(value, value)

    def finding_tuple(self, raw: list[dict[str, Any]]) -> tuple[Finding, ...]:
        key = tuple((f.get("check"), f.get("ok"), f.get("layer"), f.get("detail", ""), len(f)) for f in raw)
        found = self.findings.get(key)
        if found is None:
            found = self.findings[key] = tuple(self._finding(f) for f in raw)
        return found

    def findings_of_text(self, text: str | bytes) -> tuple[Finding, ...]:
        """The findings of a record's `"findings"` array, from its JSON text: a run repeats a few dozen
        arrays (the checks of a scenario turn, all passed) over hundreds of thousands of records."""
        found = self.findings_text.get(text)
        if found is None:
            raw = json.loads(text)
            if not isinstance(raw, list) or not all(isinstance(f, dict) for f in raw):
                raise ValueError("findings is not an array of objects")
            found = self.findings_text[text] = self.finding_tuple(raw)
        return found

    def _finding(self, raw: dict[str, Any]) -> Finding:
        finding = Finding(**raw)  # a malformed finding fails here as it does in Attempt.from_dict
        finding.check, finding.layer, finding.detail = self(finding.check), self(finding.layer), self(finding.detail)
        return finding


def lean_attempt(record: dict[str, Any], shared: Interner) -> LeanAttempt:
    """The lean form of a record read whole (a line `analysis/run/record_decode.py` refused); a record missing
    a required field raises TypeError like `Attempt(**record)`."""
    if not record.keys() >= REQUIRED:
        missing = sorted(REQUIRED - record.keys())
        raise TypeError(f"Attempt.__init__() missing required arguments: {', '.join(map(repr, missing))}")
    for name in ("attempt", "turn"):  # numbers every rule orders and groups by: a "2" or 1.0 is no record of ours
        if type(record[name]) is not int:
            raise TypeError(f"{name} is {_shown(record[name])}, not an integer")
    get, intern, num = record.get, shared.intern, plain_number
    findings = shared.finding_tuple(get("findings") or [])
    layer = get("primary_layer")
    valid = get("valid", True)
    if type(valid) is not bool:  # counted as valid or not by every rule: "yes" is neither
        raise TypeError(f"valid is {_shown(valid)}, not true or false")
    if layer is None and not valid:  # written before primary_layer existed: the same rule, from its findings
        layer = derived_layer(findings)
    http_status = get("http_status")
    names = tuple(map(call_name, get("tool_calls") or ()))
    names = intern(names, names) if names else ()  # one tuple (and one string per name) across the run
    stage, scenario, family, user, status = (record["stage"], record["scenario"], record["family"],
                                             record["user_id"], record["status"])
    request, prefix, finish, role = (record["request_sha256"], record["prefix_sha256"], get("finish_reason"),
                                     get("control_role"))
    stream_role = get("stream_role")
    return LeanAttempt(
        record["attempt_id"], record["chain_id"], record["attempt"], intern(stage, stage),
        intern(scenario, scenario), intern(family, family), record["turn"], intern(user, user),
        intern(request, request), intern(prefix, prefix), intern(status, status),
        record["send_ts"], record["end_ts"], num(get("first_token_ts")), num(get("ttft_ms")), num(get("e2e_ms")),
        num(get("chunks", 0), 0), num(get("prompt_tokens")), num(get("cached_tokens")), num(get("request_bytes")),
        intern(finish, finish), http_status, get("error_body") if http_status == 400 else None,
        names, findings, valid, get("will_retry", False), get("drill", False), intern(layer, layer),
        get("control_pair"), intern(role, role), get("stream_pair"), intern(stream_role, stream_role),
        num(get("tool_call_span_ms")), num(get("tool_call_max_gap_ms")), num(get("tool_call_deltas")),
        num(get("last_silence_ms")), get("temperature"), get("seed"), get("stream", True), num(get("stream_reads")),
        num(get("stream_bytes")),
        get("history"), get("model_round"), _signature(record, shared),
        intern(get("path"), get("path")))


def _shown(value: Any) -> str:
    """A refused value named by its JSON type and its start, never the whole of a long one."""
    kind = {bool: "a boolean", str: "a string", float: "a number with a fraction", type(None): "null",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)
    return f"{kind} ({json.dumps(value)[:40]})"


def _signature(record: dict[str, Any], shared: Interner) -> str | None:
    """An answer's `answer_signature` where it is ever compared, one string per distinct one across the run."""
    get = record.get
    turn_kind, content = get("turn_kind"), get("content")
    if not compared(turn_kind, record["status"], get("temperature"), get("seed")):
        return None
    found = answer_signature(turn_kind, get("tool_calls"), content if isinstance(content, str) else None)
    return None if found is None else shared.intern(found, found)
