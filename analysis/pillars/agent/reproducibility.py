"""Tool calls that must repeat: every request answered more than once at temperature 0 (or with a fixed `seed`),
its answers compared.

Why: the seed names non-reproducible tool calls a rollback condition. An agent whose call changes with what else
the server is doing acts in production otherwise than in the acceptance run. vLLM is not batch-invariant by
default: its kernels reduce in an order that depends on the batch, so the same greedy request can take a near-tie
token the other way when the batch around it changes; its beta batch-invariant mode (`VLLM_BATCH_INVARIANT=1`)
makes the output "deterministic and independent of the batch size or the order of requests in a batch"
(docs.vllm.ai/en/v0.32.0/features/batch_invariance/). So a difference seen only under load is named
batch-dependent, with that switch as the way to tell the engine from the model.

What is a repeat. The same bytes (`request_sha256`) answered in separate chains: a retry is the same chain
again, not a repeat of its answer. Of each chain the first answer that completed (status ok) is taken: a
transport failure is no disagreement. Only requests that must repeat: `temperature` 0 or a `seed` in the body
(a body without a temperature is sampled at the server's default, and records older than the field cannot say
which). Streaming-equivalence twins differ in their `stream` flag, so in their bytes: they are their drill's.

What is compared (`answer_signature`), for turns that expect a tool call or structured output; answer turns
compare nothing (prose may differ and still be right). The calls' names and arguments, each argument parsed and
written as canonical JSON (keys sorted, no spaces, a whole float as its integer), arguments that are not JSON as
their raw text; the calls as a multiset (sorted), because a parallel call list in another order is the same
action; the call ids never (they differ between answers legitimately). On a `json` turn the content too, as
canonical JSON (raw text when not JSON). A signature longer than SIGNATURE_CAP is kept as its sha256.

The records: a whole `Attempt` (the unit tests') is read here; a lean one (`analysis/run/lean.py`) carries its
signature as `answer_signature`, computed by this module's function when the line was read. A lean attempt
without that field (a reader that kept no arguments) cannot be compared: said, never guessed.

Usage: `reproducibility(attempts, users_by_stage)` -> `Reproducibility` (`.rate`, `.to_dict()`);
`judge(result, threshold)` -> the agent pillar's rule `agent.reproducibility`; `holds_the_pillar` says whether
it decides the pillar's status.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from k3load.analysis.pillars.rules import RuleResult
from k3load.analysis.run.answer_signature import _dumps, answer_signature, compared, repeats
from k3load.analysis.run.clusters import rate_by_keys
from k3load.analysis.run.stats import (
    MIN_DISTINCT_REQUESTS,
    Rate,
    decide_rate,
    more_requests_to_decide,
    too_few_requests,
)
from k3load.outcomes import FAIL, INCONCLUSIVE, PASS, Pillar
from k3load.records import Attempt

PILLAR = Pillar.AGENT_API  # the pillar these rules judge

if TYPE_CHECKING:
    from k3load.analysis.run.lean import AnyAttempt

FIRST_DIFFERENCES = 5
UNREAD = object()  # a lean attempt read without its signature


def signature_of(attempt: AnyAttempt) -> Any:
    """An attempt's signature (None: not compared), or UNREAD for a lean attempt read without it."""
    if isinstance(attempt, Attempt):
        if not compared(attempt.turn_kind, attempt.status, attempt.temperature, attempt.seed):
            return None
        return answer_signature(attempt.turn_kind, attempt.tool_calls, attempt.content)
    return getattr(attempt, "answer_signature", UNREAD)


def must_repeat(attempt: AnyAttempt) -> bool:
    """Sent at temperature 0, or with a seed: its answer must be the same every time."""
    return repeats(getattr(attempt, "temperature", None), getattr(attempt, "seed", None))


@dataclass(frozen=True)
class Answer:
    """One chain's answer to a request that must repeat."""

    request_sha256: str
    attempt_id: str
    stage: str
    send_ts: float
    signature: str
    scenario: str
    turn: int


@dataclass(frozen=True)
class Difference:
    """Two answers to the same bytes that differ: the reference (the request's first answer at its lowest
    concurrency) and the first that differs from it."""

    request_sha256: str
    scenario: str
    turn: int
    stages: tuple[str, str]
    attempt_ids: tuple[str, str]
    what: str

    def to_dict(self) -> dict[str, Any]:
        return {"request_sha256": self.request_sha256, "scenario": self.scenario, "turn": self.turn,
                "stages": list(self.stages), "attempt_ids": list(self.attempt_ids), "what": self.what}


@dataclass
class StageAgreement:
    users: int | None
    repeated_requests: int = 0
    agreeing: int = 0
    keys: list[str] = field(default_factory=list)
    flags: list[bool] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        rate = rate_by_keys(self.keys, self.flags)
        return {"users": self.users, "repeated_requests": self.repeated_requests, "agreeing": self.agreeing,
                "share": rate.value, "share_ci95": [rate.low, rate.high] if rate.n else None}


@dataclass
class Reproducibility:
    """The repeats of a run: per distinct request whether all its answers agree (`rate`: one trial each)."""

    rate: Rate
    answers: int  # answers compared (one per chain of a repeated request)
    unread: int  # lean attempts read without a signature
    by_stage: dict[str, StageAgreement]
    differences: list[Difference]
    base_stage: str | None  # the lowest concurrency at which repeats were compared
    batch_dependent: bool | None  # every difference under more load than its reference; None: none, or unknown
    differing_stages: list[str]
    base_users: int | None = None  # the base stage's concurrency (it may have no row: only references there)

    def to_dict(self) -> dict[str, Any]:
        return {"repeated_requests": self.rate.n, "agreeing": self.rate.k, "share": self.rate.value,
                "share_ci95": [self.rate.low, self.rate.high] if self.rate.n else None,
                "answers_compared": self.answers, "base_stage": self.base_stage,
                "batch_dependent": self.batch_dependent,
                "by_stage": {name: row.to_dict() for name, row in self.by_stage.items()},
                "differences": [d.to_dict() for d in self.differences]}


def _answers(attempts: Sequence[AnyAttempt]) -> tuple[dict[str, list[Answer]], int]:
    """Per request that must repeat, one answer per chain (its first that completed), in send order."""
    firsts: dict[str, AnyAttempt] = {}
    unread = 0
    for attempt in attempts:
        if attempt.status != "ok" or attempt.drill or not must_repeat(attempt):
            continue
        known = firsts.get(attempt.chain_id)
        if known is None or attempt.attempt < known.attempt:
            firsts[attempt.chain_id] = attempt
    by_request: dict[str, list[Answer]] = {}
    for attempt in sorted(firsts.values(), key=lambda a: (a.send_ts, a.attempt_id)):
        signature = signature_of(attempt)
        if signature is UNREAD:
            unread += 1
            continue
        if signature is None:
            continue
        by_request.setdefault(attempt.request_sha256, []).append(Answer(
            attempt.request_sha256, attempt.attempt_id, attempt.stage, attempt.send_ts, signature, attempt.scenario,
            attempt.turn))
    return by_request, unread


def reproducibility(attempts: Sequence[AnyAttempt], users_by_stage: Mapping[str, int] | None = None
                    ) -> Reproducibility:
    """Every request that must repeat and was answered in two chains or more, compared (module docstring).
    `users_by_stage`: each stage's concurrency (the plan's users, in plan order), which orders the stages.

    A request's reference is its first answer at the lowest concurrency it was answered at; per stage, a
    request counts where it has an answer other than its reference, and agrees there when all of them are
    the reference's. Batch-dependent: every differing answer came at a stage with more users than the base (the
    lowest concurrency any compared answer came from), and the base agrees throughout."""
    users = dict(users_by_stage or {})
    by_request, unread = _answers(attempts)
    repeated = {k: v for k, v in by_request.items() if len(v) > 1}
    by_stage: dict[str, StageAgreement] = {}
    keys, flags, found = [], [], []
    for request, answers in repeated.items():
        reference = min(answers, key=lambda a: (users.get(a.stage, math.inf), a.send_ts))
        keys.append(request)
        flags.append(all(a.signature == reference.signature for a in answers))
        _tally_stages(by_stage, users, reference, answers)
        found += [(other, reference) for other in answers if other.signature != reference.signature]
    found.sort(key=lambda pair: (pair[0].send_ts, pair[0].attempt_id))
    order = {name: i for i, name in enumerate(users)}
    ordered = dict(sorted(by_stage.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))
    # the base: the lowest concurrency any compared answer came from, references included (a request answered once
    # alone and once under load has its alone answer only as the reference: that stage has no row of its own)
    answered = {a.stage for answers in repeated.values() for a in answers}
    base = min(answered, key=lambda s: (users.get(s, math.inf), order.get(s, len(order)), s), default=None)
    batch = None
    if found and users and base is not None:
        quiet = base not in ordered or ordered[base].agreeing == ordered[base].repeated_requests
        # differences only under load: every differing answer came at more users than the base (two answers at 12
        # users that differ are two different batches too: batch-dependent, not the model)
        batch = quiet and all(users.get(other.stage, -1) > users.get(base, math.inf) for other, _ in found)
    differing = {other.stage for other, _ in found}
    return Reproducibility(rate_by_keys(keys, flags), sum(len(v) for v in repeated.values()), unread, ordered,
                           [_difference(other, reference) for other, reference in found[:FIRST_DIFFERENCES]],
                           base, batch, [s for s in ordered if s in differing], users.get(base) if base else None)


def _tally_stages(by_stage: dict[str, StageAgreement], users: Mapping[str, int], reference: Answer,
                  answers: list[Answer]) -> None:
    for stage in dict.fromkeys(a.stage for a in answers if a is not reference):
        same = all(a.signature == reference.signature for a in answers if a.stage == stage and a is not reference)
        row = by_stage.setdefault(stage, StageAgreement(users.get(stage)))
        row.repeated_requests += 1
        row.agreeing += same
        row.keys.append(reference.request_sha256)
        row.flags.append(same)


def _difference(other: Answer, reference: Answer) -> Difference:
    return Difference(reference.request_sha256, reference.scenario, reference.turn, (reference.stage, other.stage),
                      (reference.attempt_id, other.attempt_id), what_differs(reference.signature, other.signature))


def what_differs(a: str, b: str) -> str:
    """In a few words, where two signatures part: the tools called, an argument's keys or values, the
    structured output."""
    if a.startswith("sha256:") or b.startswith("sha256:"):
        return "the answers differ (too long to show: compared by their sha256)"
    left, right = json.loads(a), json.loads(b)
    names = [c["name"] for c in left["calls"]], [c["name"] for c in right["calls"]]
    if sorted(names[0]) != sorted(names[1]):
        return f"tools called: {sorted(names[0])} vs {sorted(names[1])}"
    parts = []
    for one, two in zip(left["calls"], right["calls"], strict=True):
        if one["arguments"] == two["arguments"]:
            continue
        x, y = one["arguments"].get("json"), two["arguments"].get("json")
        if isinstance(x, dict) and isinstance(y, dict):
            if set(x) != set(y):
                parts.append(f"{one['name']} argument keys {sorted(x)} vs {sorted(y)}")
            else:
                changed = [k for k in sorted(x) if x[k] != y[k]]
                parts.append(f"{one['name']} arguments " + ", ".join(
                    f"{k}: {_short(x[k])} vs {_short(y[k])}" for k in changed[:3]))
        else:
            parts.append(f"{one['name']} arguments {_short(one['arguments'])} vs {_short(two['arguments'])}")
    if left.get("output") != right.get("output"):
        parts.append(f"structured output {_short(left.get('output'))} vs {_short(right.get('output'))}")
    return "; ".join(parts) or "the answers differ"


def _short(value: Any, limit: int = 60) -> str:
    text = _dumps(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


RULE = "agent.reproducibility"
EVIDENCE = ("records.jsonl request_sha256, chain_id, tool_calls, content (temperature 0 or a seed)",)
SWITCH = ("vLLM is not batch-invariant by default; rerun with VLLM_BATCH_INVARIANT=1 (its beta batch-invariant mode) "
          "to tell the engine from the model: a difference that stays is the model's")


def judge(result: Reproducibility, threshold: float) -> RuleResult:
    """The share of repeated requests that answered alike against `min_reproducible_share`, decided on its
    interval as every rate is (`stats.decide_rate`: one trial per distinct request, fewer than 10 decide
    nothing). A fail is the seed's rollback condition, named in its words."""
    rate = result.rate
    if not rate.n:
        why = ("the records were read without the answers' arguments (analysis/run/lean.py keeps no answer_signature)"
               if result.unread else "no request that must repeat (temperature 0 or a seed) was answered in two "
                                     "chains or more")
        return RuleResult(RULE, PILLAR, INCONCLUSIVE, f"reproducibility of tool calls inconclusive, because {why}",
                          None, threshold, evidence=EVIDENCE)
    status = decide_rate(rate, threshold)
    share = f"{rate.value:.1%} (95% CI {rate.low:.1%}-{rate.high:.1%})"
    where = _where(result)
    if status == FAIL:
        text = (f"non-reproducible tool calls: {rate.n - rate.k} of {rate.n} requests sent more than once at "
                f"temperature 0 answered differently ({share} alike, at least {threshold:.0%} required){where}: the "
                "seed's rollback condition")
    elif status == PASS:
        text = f"tool calls reproducible: {rate.k} of {rate.n} repeated requests answered alike ({share})"
    else:
        few = too_few_requests(rate)
        more = more_requests_to_decide(rate, threshold)
        because = (f"{few} were answered more than once (at least {MIN_DISTINCT_REQUESTS} are needed)" if few else
                   "the interval straddles the threshold" + (f" (about {more} more repeated requests would decide)"
                                                             if more else ""))
        text = (f"reproducibility of tool calls inconclusive, because {because}: {rate.k} of {rate.n} repeated "
                f"requests answered alike ({share}, {threshold:.0%} required){where}")
    return RuleResult(RULE, PILLAR, status, text, rate.value, threshold, evidence=EVIDENCE,
                      interval=(rate.low, rate.high))


def holds_the_pillar(rule: RuleResult, result: Reproducibility) -> bool:
    """Whether the rule decides the pillar's status: a fail, or an undecided share with differences seen. An
    undecided share without any difference does not: 99% is cleared only from about 370 repeated requests all
    alike, which no short run repeats; it is said beside the pillar's reasons instead, never passed silently."""
    return rule.status == FAIL or (rule.status == INCONCLUSIVE and result.rate.k < result.rate.n)


def _where(result: Reproducibility) -> str:
    """Where the answers differed, the batch-dependent wording, and the first difference."""
    if not result.differences:
        return ""
    stages = ", ".join(f"{s} ({_users(result.by_stage[s].users)})" for s in result.differing_stages)
    base = result.base_stage
    users = result.base_users
    if result.batch_dependent:
        said = (f"; batch-dependent: the repeats agreed at {base} ({_users(users)}), the lowest concurrency compared, "
                f"and differed only under more load, at {stages}: {SWITCH}")
    elif result.batch_dependent is False:
        said = (f"; not only under load: they differed at {stages}, the lowest concurrency compared ({base}, "
                f"{_users(users)}) included or as loaded as its reference: not the batch alone ({SWITCH})")
    else:
        said = f"; they differed at {stages}"
    first = result.differences[0]
    return said + (f"; first: request {first.request_sha256[:12]} ({first.scenario} turn {first.turn}), attempts "
                   f"{first.attempt_ids[0]} ({first.stages[0]}) vs {first.attempt_ids[1]} ({first.stages[1]}): "
                   f"{first.what}")


def _users(n: int | None) -> str:
    return "users unknown" if n is None else f"{n} user{'' if n == 1 else 's'}"
