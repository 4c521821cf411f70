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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from k3load.analysis.pillars.rules import RuleResult
from k3load.analysis.run.answer_signature import UNREAD, _dumps, answer_signature, compared, repeats
from k3load.analysis.run.clusters import rate_by_codes, rate_by_keys
from k3load.analysis.run.record_columns import Rows, group_heads, group_of, in_send_order
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


def reproducibility(rows: Rows, users_by_stage: Mapping[str, int] | None = None) -> Reproducibility:
    """Every request that must repeat and was answered in two chains or more, compared (module docstring).
    `users_by_stage`: each stage's concurrency (the plan's users, in plan order), which orders the stages.

    A request's reference is its first answer at the lowest concurrency it was answered at; per stage, a
    request counts where it has an answer other than its reference, and agrees there when all of them are
    the reference's. Batch-dependent: every differing answer came at a stage with more users than the base (the
    lowest concurrency any compared answer came from), and the base agrees throughout.

    On the record columns: per chain its first answer (the lowest attempt number, the first of equals in file
    order), the answers in send order (ties by attempt id), each request's answers grouped in the order its first
    answer came; the few differences shown are read whole."""
    users = dict(users_by_stage or {})
    must = rows.code_where("temperature", lambda t: repeats(t, None)) | rows.code_where("seed", lambda s: s is not None)
    chosen = rows[rows.code_is("status", "ok") & ~rows.flag("drill") & must]
    answers, unread = _answers(chosen)
    signature, request = answers.ints("answer_signature"), answers.ints("request_sha256")
    _, group = np.unique(request, return_inverse=True)
    group = group.reshape(-1)
    sizes = np.bincount(group)
    repeated = sizes[group] > 1
    answers, signature, group = answers[repeated], signature[repeated], group[repeated]
    if not len(answers):
        return Reproducibility(rate_by_keys([], []), 0, unread, {}, [], None, None, [])
    # requests numbered in the order their first answer came (the order a dict of them fills)
    first_at = np.full(int(group.max()) + 1, len(group), dtype=np.intp)
    np.minimum.at(first_at, group, np.arange(len(group)))
    rank = np.argsort(np.argsort(first_at, kind="stable"), kind="stable")
    group = rank[group]
    stages = answers.ints("stage")
    stage_table = rows.table("stage")
    stage_users = np.array([users.get(name, math.inf) for name in stage_table])  # a code table's values hash
    reference = group_heads(group, answers.number("send_ts"), stage_users[stages])  # fewest users, then sent first
    differs = signature != signature[reference[group]]
    requests = len(reference)
    alike = np.bincount(group, weights=differs, minlength=requests) == 0
    table = rows.table("request_sha256")
    keys = [table[c] for c in request[repeated][reference].tolist()]
    by_stage = _by_stage(answers, group, stages, differs, reference, keys, users, stage_table)
    order_of = {name: i for i, name in enumerate(users)}
    ordered = dict(sorted(by_stage.items(), key=lambda kv: (order_of.get(kv[0], len(order_of)), kv[0])))
    answered = [stage_table[c] for c in np.unique(stages).tolist()]
    base = min(answered, key=lambda s: (users.get(s, math.inf), order_of.get(s, len(order_of)), s), default=None)
    found = np.flatnonzero(differs)  # in send order, as the differences are sorted
    found_stages = [stage_table[c] for c in stages[found].tolist()]
    batch = None
    if len(found) and users and base is not None:
        quiet = base not in ordered or ordered[base].agreeing == ordered[base].repeated_requests
        batch = quiet and all(users.get(stage, -1) > users.get(base, math.inf) for stage in found_stages)
    differing = set(found_stages)
    shown = found[:FIRST_DIFFERENCES]
    return Reproducibility(rate_by_codes(np.arange(requests), alike), len(answers), unread, ordered,
                           _differences(answers, shown, reference[group[shown]]), base, batch,
                           [s for s in ordered if s in differing], users.get(base) if base else None)


def _answers(chosen: Rows) -> tuple[Rows, int]:
    """Of each chain its first answer, in send order (ties by attempt id), that carries a signature; and how many
    were read without one."""
    number = chosen.ints("attempt")
    _, chain = group_of(chosen.keys("chain_id"))
    firsts = chosen.take(np.sort(group_heads(chain, number)))
    firsts = firsts.take(in_send_order(firsts))
    signature = firsts.ints("answer_signature")
    table = chosen.table("answer_signature")
    unread_code = [c for c, value in enumerate(table) if value is UNREAD]
    none_code = [c for c, value in enumerate(table) if value is None]
    unread = int(np.isin(signature, unread_code).sum())
    return firsts[~np.isin(signature, unread_code + none_code)], unread


def _by_stage(answers: Rows, group: np.ndarray, stages: np.ndarray, differs: np.ndarray, reference: np.ndarray,
              keys: list[Any], users: Mapping[str, int], stage_table: list[Any]) -> dict[str, StageAgreement]:
    """Per stage, the requests with an answer there other than their reference, and whether all of those agreed."""
    others = np.ones(len(answers), dtype=bool)
    others[reference] = False
    pairs = np.stack([group[others], stages[others]], axis=1)
    if not len(pairs):
        return {}
    unique, inverse = np.unique(pairs, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    agreed = np.bincount(inverse, weights=differs[others], minlength=len(unique)) == 0
    by_stage: dict[str, StageAgreement] = {}
    for (request, stage), same in zip(unique.tolist(), agreed.tolist(), strict=True):  # requests in order
        name = stage_table[stage]
        row = by_stage.setdefault(name, StageAgreement(users.get(name)))
        row.repeated_requests += 1
        row.agreeing += same
        row.keys.append(keys[request])
        row.flags.append(same)
    return by_stage


def _differences(answers: Rows, shown: np.ndarray, references: np.ndarray) -> list[Difference]:
    """The differences shown, each against its reference, read whole from the columns."""
    out = []
    signatures = answers.table("answer_signature")
    for other, reference in zip(shown.tolist(), references.tolist(), strict=True):
        pair = answers.take(np.array([reference, other]))
        request = pair.values("request_sha256")[0]
        scenario, turn = pair.values("scenario")[0], int(pair.ints("turn")[0])
        stages = pair.values("stage")
        ids = pair.key_texts("attempt_id")
        reference_signature, other_signature = (signatures[c] for c in pair.ints("answer_signature").tolist())
        out.append(Difference(request, scenario, turn, (stages[0], stages[1]), (ids[0], ids[1]),
                              what_differs(reference_signature, other_signature)))
    return out


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
