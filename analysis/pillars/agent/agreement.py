"""Tool-call agreement of a run with a reference run (`k3load diff A B`, `--k3-reference DIR`).

    profile(rows)                     -> the reference's behaviour per scenario and turn (JSON-ready)
    agreement(profile, rows)          -> trigger precision / recall / F1, tool-name agreement, schema
                                         accuracy, structured-output validity, finish-reason mix
    reference_record(DIR)             -> what `reference.json` holds: path, run id, manifest hash, profile
    reference_rules(record, rows, limits) -> the agent pillar's rules against the reference
(`rows`: a run's record columns, analysis/run/record_columns.py)

Why a trigger F1 (MoonshotAI's K2-Vendor-Verifier "ToolCalls-Trigger Similarity"): a deployment whose
model answers in prose where the trusted one called a tool breaks agents without a single malformed
byte; every other check passes on it. A "trigger" is an answer that carries tool calls or finishes
with `tool_calls`. Why per scenario and turn, with the reference's majority as the label: the two
runs' attempts are not paired one to one (different counts, retries, concurrency), but the same
scenario turn sends the same conversation, so the reference's majority behaviour on that turn is the
label and each answer of the judged run on it is a prediction. A turn the reference split evenly has
no label and is left out (counted as not comparable), as are turns the reference never answered.
Only answered attempts count (status ok, no drill): a timeout says nothing about the model's choice. A
model-driven conversation's requests after its first (`history: model`) carry the model's own answers, so
they send no scenario turn's conversation and are left out on both sides (lean.designed_body).

Why these intervals: precision, recall and the other rates are proportions (Wilson). F1 is not, but
it is a monotone function of the Jaccard index J = TP / (TP + FP + FN), F1 = 2J / (1 + J), and given
the number of disagreeing-or-triggered predictions TP is binomial in J: the Wilson interval of J,
mapped through that function, is F1's interval, exact in the same sense and the same bytes anywhere.
A drop between two rates gets Newcombe's hybrid score interval (built from the two Wilson intervals).
The reference's own labels are taken as fixed: its noise is not in the intervals.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3load.analysis.pillars.rules import RuleResult
from k3load.analysis.run.clusters import cluster_codes, rate_by_codes
from k3load.analysis.run.lean import call_name, first_finding
from k3load.analysis.run.record_columns import Rows, designed_body_rows
from k3load.analysis.run.rundata import read_columns
from k3load.analysis.run.stats import Rate, wilson
from k3load.errors import InputError
from k3load.evidence import records_file
from k3load.outcomes import FAIL, INCONCLUSIVE, MODEL_OUTPUT, PASS, Pillar
from k3load.records import Finding

PILLAR = Pillar.AGENT_API  # the pillar these rules judge

REFERENCE_FILE = "reference.json"
TOOL_CALL, ANSWER = "tool_call", "answer"


class ReferenceRunError(InputError):
    """A reference that cannot be used (not a run directory, no records, never signed): names the path."""


def answered(rows: Rows) -> np.ndarray:
    """Whether each row is an answer that says what the model chose: ok, no drill, its scenario's designed body
    (a model-driven conversation's requests after its first carry the model's own answers: `lean.designed_body`)."""
    found: np.ndarray = rows.code_is("status", "ok") & ~rows.flag("drill") & designed_body_rows(rows)
    return found


def triggered(rows: Rows) -> np.ndarray:
    """Whether each row's answer carries tool calls or finished with `tool_calls`."""
    found: np.ndarray = rows.code_where("tool_calls", bool) | rows.code_is("finish_reason", "tool_calls")
    return found


def tool_names(calls: Sequence[Any]) -> tuple[str, ...]:
    """The called tools' names, sorted (a parallel answer's calls as a multiset), from a recorded calls list or a
    lean record's names."""
    return tuple(sorted(call_name(c) for c in calls))


def findings_schema_ok(findings: Sequence[Finding]) -> bool:
    """As the agent pillar counts schema accuracy: no failed `tool_call.*` finding."""
    return not any(not f.ok and f.check.startswith("tool_call.") for f in findings)


def json_valid(findings: Sequence[Finding]) -> bool | None:
    """Structured output (`expect.json`) held; None when the turn asked for none."""
    found = first_finding(findings, "expect.json")
    return None if found is None else found.ok


def _key(scenario: str, turn: int) -> str:
    return f"{scenario}#{turn}"


def _label(answers: int, hits: int) -> str | None:
    if not answers or hits * 2 == answers:
        return None  # never answered, or split evenly: no label
    return TOOL_CALL if hits * 2 > answers else ANSWER


@dataclass(frozen=True)
class _Answers:
    """A run's answers (`answered`) as the agreement reads them. `rows` in file order; `turned`: the same rows in
    (scenario, turn) order, file order within a turn (a stable sort's), with per row of it: its turn's number
    among `turns` (the (scenario, turn) pairs in that order), whether it triggered and its tools' names. Why
    both orders: a rate's interval sums its clusters in the order its list met them (the module's rates over
    the calls and the structured outputs are over file order, those scored against a label over turn order)."""

    rows: Rows
    turned: Rows
    turns: list[tuple[Any, int]]
    turn_of: np.ndarray
    hit: np.ndarray
    names: list[tuple[str, ...]]

    @classmethod
    def of(cls, rows: Rows) -> _Answers:
        mine = rows[answered(rows)]
        scenario, turn = mine.ints("scenario").astype(np.int64), mine.ints("turn")
        table = mine.table("scenario")
        present = np.unique(scenario).tolist()
        rank = np.zeros(len(table), dtype=np.int64)
        rank[sorted(present, key=table.__getitem__)] = np.arange(len(present))  # by the scenario's name
        order = np.lexsort((turn, rank[scenario]))  # stable: file order within a turn
        turned = mine.take(order)
        scenario, turn = scenario[order], turn[order]
        starts = np.ones(len(order), dtype=bool)
        starts[1:] = (scenario[1:] != scenario[:-1]) | (turn[1:] != turn[:-1])
        heads = np.flatnonzero(starts)
        calls = turned.table("tool_calls")
        names_of = [tool_names(c) for c in calls]
        return cls(mine, turned, [(table[s], int(t)) for s, t in zip(scenario[heads].tolist(), turn[heads].tolist(),
                                                                      strict=True)],
                   np.cumsum(starts) - 1, triggered(turned), [names_of[c] for c in turned.ints("tool_calls").tolist()])


def _finish_reasons(rows: Rows) -> dict[str, int]:
    """Each finish reason's count, as text (`str(None)` for none), by the text."""
    counted = Counter[str]()
    for value, n in rows.counts("finish_reason").items():
        counted[str(value)] += n
    return dict(sorted(counted.items()))


def profile(rows: Rows) -> dict[str, Any]:
    """The behaviour of a run per scenario and turn, and its overall rates, as plain JSON data (what
    reference.json keeps, so a run judged against a reference needs only its own directory)."""
    found = _Answers.of(rows)
    answers = np.bincount(found.turn_of, minlength=len(found.turns))
    hits = np.bincount(found.turn_of, weights=found.hit, minlength=len(found.turns))
    names: dict[int, Counter[tuple[str, ...]]] = {}
    for turn, called in zip(found.turn_of[found.hit].tolist(),
                            (n for n, h in zip(found.names, found.hit.tolist(), strict=True) if h), strict=True):
        names.setdefault(turn, Counter())[called] += 1
    turns: dict[str, dict[str, Any]] = {}
    for i, (scenario, turn) in enumerate(found.turns):
        common = sorted((names.get(i) or Counter()).items(), key=lambda kv: (-kv[1], kv[0]))
        turns[_key(scenario, turn)] = {"scenario": scenario, "turn": turn, "answers": int(answers[i]),
                                       "triggered": int(hits[i]), "label": _label(int(answers[i]), int(hits[i])),
                                       "tool_names": list(common[0][0]) if common else None}
    calls = found.turned[found.hit]
    structured = found.rows.code_where("findings", lambda f: json_valid(f) is not None)
    held = found.rows.code_where("findings", lambda f: bool(json_valid(f)))
    return {"answers": len(found.rows), "turns": [turns[k] for k in sorted(turns)],
            "schema": {"k": int(calls.code_where("findings", findings_schema_ok).sum()), "n": len(calls)},
            "structured_output": {"k": int(held.sum()), "n": int(structured.sum())},
            "finish_reasons": _finish_reasons(found.rows)}


def f1_interval(tp: int, fp: int, fn: int, jaccard: Rate | None = None
                ) -> tuple[float | None, tuple[float, float] | None]:
    """F1 and its 95% interval through the Jaccard index (module docstring); None when neither side
    triggered on a comparable turn (F1 undefined). `jaccard`: the index's rate over distinct requests (the
    run's answers repeat their requests), else Wilson's over the counts."""
    m = tp + fp + fn
    if not m:
        return None, None
    j = jaccard if jaccard is not None else wilson(tp, m)
    return 2 * tp / (2 * tp + fp + fn), (2 * j.low / (1 + j.low), 2 * j.high / (1 + j.high))


def drop(reference: Rate, run: Rate) -> tuple[float | None, tuple[float, float] | None]:
    """reference - run with Newcombe's hybrid score 95% interval (method 10); None without both."""
    if not reference.n or not run.n:
        return None, None
    p1, p2 = reference.k / reference.n, run.k / run.n
    d = p1 - p2
    low = d - math.sqrt((p1 - reference.low) ** 2 + (run.high - p2) ** 2)
    high = d + math.sqrt((reference.high - p1) ** 2 + (p2 - run.low) ** 2)
    return d, (low, high)


def _compared(reference: Rate, run: Rate) -> dict[str, Any]:
    value, interval = drop(reference, run)
    return {"reference": reference.to_dict(), "run": run.to_dict(), "drop": value,
            "drop_ci95": list(interval) if interval else None}


def _mix(counts: dict[str, int]) -> dict[str, Any]:
    total = sum(counts.values())
    return {reason: wilson(k, total).to_dict() for reason, k in sorted(counts.items())}


def _among(scored: Rows, outcomes: np.ndarray, among: tuple[str, ...]) -> Rate:
    """The share of true positives among the answers scored one of `among`, by distinct request (their clusters
    in the order of `scored`)."""
    picked = np.isin(outcomes, among)
    return rate_by_codes(cluster_codes(scored[picked]), outcomes[picked] == "tp")


def agreement(reference: dict[str, Any], rows: Rows) -> dict[str, Any]:
    """The judged run's answers against the reference profile (module docstring for the definitions): each
    answer scored against its turn's label, rows per turn, totals, the primary layers of the disagreeing
    answers, the tool names of the agreeing calls."""
    turns = {_key(t["scenario"], t["turn"]): t for t in reference.get("turns") or []}
    found = _Answers.of(rows)
    refs = [turns.get(_key(scenario, turn)) for scenario, turn in found.turns]
    labelled = np.array([ref is not None and ref["label"] is not None for ref in refs] + [False], dtype=bool)
    want = np.array([ref is not None and ref["label"] == TOOL_CALL for ref in refs] + [False], dtype=bool)
    comparable = labelled[found.turn_of] if len(found.turn_of) else np.zeros(0, dtype=bool)
    wanted = want[found.turn_of] if len(found.turn_of) else np.zeros(0, dtype=bool)
    hit = found.hit
    outcome = np.where(hit, np.where(wanted, "tp", "fp"), np.where(wanted, "fn", "tn"))
    scored, outcomes, turn_of = found.turned[comparable], outcome[comparable], found.turn_of[comparable]
    names = [n for n, c in zip(found.names, comparable.tolist(), strict=True) if c]
    expected = [(refs[t] or {}).get("tool_names") for t in turn_of.tolist()]
    named = np.array([o == "tp" and e is not None for o, e in zip(outcomes.tolist(), expected, strict=True)],
                     dtype=bool)
    same = np.array([e is not None and list(n) == list(e) for n, e in zip(names, expected, strict=True)],
                    dtype=bool) & named
    by_turn: dict[str, dict[str, Any]] = {}
    for t in np.unique(turn_of).tolist():
        ref, mine = refs[t], turn_of == t
        assert ref is not None
        scenario, turn = found.turns[t]
        counts = {o: int(np.count_nonzero(outcomes[mine] == o)) for o in ("tp", "fp", "fn", "tn")}
        by_turn[_key(scenario, turn)] = {
            "scenario": scenario, "turn": turn, "reference_label": ref["label"],
            "reference_triggered": ref["triggered"], "reference_answers": ref["answers"],
            "answers": int(mine.sum()), "triggered": int(hit[comparable][mine].sum()), **counts,
            "names_same": int(same[mine].sum()), "names_compared": int(named[mine].sum()),
            "recall": _among(scored[mine], outcomes[mine], ("tp", "fn")).to_dict()
            if counts["tp"] + counts["fn"] else None}
    tp, fp, fn, tn = (int(np.count_nonzero(outcomes == o)) for o in ("tp", "fp", "fn", "tn"))
    f1, f1_ci = f1_interval(tp, fp, fn, _among(scored, outcomes, ("tp", "fp", "fn")))

    def share(among: tuple[str, ...]) -> Rate:  # tp among the answers with these outcomes, by distinct request
        return _among(scored, outcomes, among) if np.isin(outcomes, among).any() else wilson(0, 0)
    disagreeing = scored[np.isin(outcomes, ("fp", "fn"))]
    layers = Counter[str]()
    for layer in disagreeing.values("primary_layer"):  # in scored order: the first key of equal ones is kept
        layers[layer or MODEL_OUTPUT] += 1
    calls = found.rows[triggered(found.rows)]  # file order, as the answers were read
    judged = found.rows[found.rows.code_where("findings", lambda f: json_valid(f) is not None)]
    return {
        "comparable": tp + fp + fn + tn, "not_comparable": int(np.count_nonzero(~comparable)),
        "trigger": {"tp": tp, "fp": fp, "fn": fn, "tn": tn, "precision": share(("tp", "fp")).to_dict(),
                    "recall": share(("tp", "fn")).to_dict(), "f1": f1, "f1_ci95": list(f1_ci) if f1_ci else None},
        "disagreeing_by_layer": dict(sorted(layers.items())),
        "tool_name_agreement": rate_by_codes(cluster_codes(scored[named]), same[named]).to_dict(),
        "schema_accuracy": _compared(_rate(reference.get("schema")),
                                     rate_by_codes(cluster_codes(calls), calls.code_where("findings",
                                                                                           findings_schema_ok))),
        "structured_output_validity": _compared(_rate(reference.get("structured_output")), rate_by_codes(
            cluster_codes(judged), judged.code_where("findings", lambda f: bool(json_valid(f))))),
        "finish_reasons": {"reference": _mix(reference.get("finish_reasons") or {}),
                           "run": _mix(_finish_reasons(found.rows))},
        "by_turn": [by_turn[k] for k in sorted(by_turn)],
    }


def _rate(counts: dict[str, int] | None) -> Rate:
    counts = counts or {}
    return wilson(int(counts.get("k", 0)), int(counts.get("n", 0)))


# -- the reference run on disk ------------------------------------------------------------------------

def reference_record(ref_dir: Path) -> dict[str, Any]:
    """What a run keeps of its reference (reference.json): where it was, its run id, the sha256 of its
    manifest.sha256 (the signed record it names) and its profile. A reference must be a judged, signed
    run: one without a manifest cannot be named, so it is refused, as is one without answers."""
    if not ref_dir.is_dir():
        raise ReferenceRunError(f"reference {ref_dir}: not a directory")
    records = records_file(ref_dir)
    missing = [path.name for path in (records, ref_dir / "run.json", ref_dir / "manifest.sha256") if not path.is_file()]
    if missing:
        raise ReferenceRunError(f"reference {ref_dir}: not a judged run directory (missing {', '.join(missing)}; "
                                "run `k3load analyze` on it first)")
    try:
        run = json.loads((ref_dir / "run.json").read_text())
        rows = read_columns(records).rows()
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ReferenceRunError(f"reference {ref_dir}: unreadable ({type(exc).__name__}: {exc})") from None
    found = profile(rows)
    if not found["answers"]:
        raise ReferenceRunError(f"reference {ref_dir}: no answered request in records.jsonl")
    manifest = hashlib.sha256((ref_dir / "manifest.sha256").read_bytes()).hexdigest()
    return {"path": str(ref_dir.resolve()), "run_id": run.get("run_id"), "manifest_sha256": manifest,
            "profile": found}


def read_reference(run_dir: Path, problems: list[str] | None = None) -> dict[str, Any] | None:
    """The run's reference.json, None when the run has none; an unreadable one is said in `problems`."""
    path = run_dir / REFERENCE_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        if isinstance(record, dict) and isinstance(record.get("profile"), dict):
            return record
    except (OSError, ValueError):
        pass
    if problems is not None:
        problems.append(f"{REFERENCE_FILE}: unreadable, the reference was not judged")
    return None


# -- the agent pillar's rules against the reference ---------------------------------------------------

def _decide(low: float, high: float, threshold: float) -> str:
    return PASS if low >= threshold else FAIL if high < threshold else INCONCLUSIVE


def _layer(numbers: dict[str, Any]) -> str:
    """The layer most disagreeing answers were blamed on (model_output when none was blamed)."""
    layers = numbers["disagreeing_by_layer"]
    return max(sorted(layers), key=lambda k: layers[k]) if layers else MODEL_OUTPUT


def reference_rules(record: dict[str, Any], rows: Rows, limits: dict[str, float]
                    ) -> tuple[dict[str, Any], list[RuleResult]]:
    """Trigger F1 against `min_reference_trigger_f1` and the schema-accuracy drop against
    `max_reference_schema_accuracy_drop`; inconclusive below `min_reference_attempts` comparable answers."""
    numbers = agreement(record["profile"], rows)
    numbers = {"run_id": record.get("run_id"), "manifest_sha256": record.get("manifest_sha256"),
               "path": record.get("path"), **numbers}
    who = f"against reference {record.get('run_id')}"
    evidence = (f"records.jsonl, {REFERENCE_FILE} (manifest sha256 {str(record.get('manifest_sha256'))[:16]}…)",)
    need = int(limits["min_reference_attempts"])
    if numbers["comparable"] < need:
        return numbers, [RuleResult("agent.reference_agreement", PILLAR, INCONCLUSIVE,
                                    f"{who}: inconclusive, because only {numbers['comparable']} answers were "
                                    f"comparable (same scenario and turn, the reference's behaviour decided; at least "
                                    f"{need} are needed)", numbers["comparable"], need, evidence=evidence)]
    return numbers, [_f1_rule(numbers, limits["min_reference_trigger_f1"], who, evidence),
                     _schema_rule(numbers, limits["max_reference_schema_accuracy_drop"], who, evidence)]


def _f1_rule(numbers: dict[str, Any], threshold: float, who: str, evidence: tuple[str, ...]) -> RuleResult:
    trig = numbers["trigger"]
    if trig["f1"] is None:
        return RuleResult("agent.reference_trigger_f1", PILLAR, INCONCLUSIVE,
                          f"{who}: trigger F1 inconclusive, because neither run called a tool on a comparable turn",
                          None, threshold, evidence=evidence)
    low, high = trig["f1_ci95"]
    status = _decide(low, high, threshold)
    recall, precision = Rate.from_dict(trig["recall"]), Rate.from_dict(trig["precision"])
    said = (f"{who}: trigger F1 {trig['f1']:.3f} [{low:.3f}, {high:.3f}] {'<' if status == FAIL else 'vs'} "
            f"{threshold:g} (recall {recall.text()}: {trig['fn']} tool calls the reference made were answered "
            f"without one; precision {precision.text()}: {trig['fp']} calls where it answered)")
    said = _phrased(status, said, f"{_layer(numbers)}: {said}: the model's choice to call a tool differs from the "
                    "reference's", "threshold")
    return RuleResult("agent.reference_trigger_f1", PILLAR, status, said, trig["f1"], threshold,
                      evidence=evidence, interval=(low, high))


def _schema_rule(numbers: dict[str, Any], max_drop: float, who: str, evidence: tuple[str, ...]) -> RuleResult:
    schema = numbers["schema_accuracy"]
    if schema["drop"] is None:
        return RuleResult("agent.reference_schema_accuracy", PILLAR, INCONCLUSIVE,
                          f"{who}: schema accuracy inconclusive, because "
                          f"{'the reference' if not schema['reference']['n'] else 'this run'} has no tool-call answer",
                          None, max_drop, evidence=evidence)
    low, high = schema["drop_ci95"]
    status = FAIL if low > max_drop else PASS if high <= max_drop else INCONCLUSIVE
    ref, run = Rate.from_dict(schema["reference"]), Rate.from_dict(schema["run"])
    said = (f"{who}: tool-call argument schema accuracy {run.text()} against the reference's {ref.text()}: drop "
            f"{schema['drop']:.1%} [{low:.1%}, {high:.1%}], at most {max_drop:.0%} allowed")
    said = _phrased(status, said, f"model_output: {said}", "limit")
    return RuleResult("agent.reference_schema_accuracy", PILLAR, status, said, schema["drop"], max_drop,
                      evidence=evidence, interval=(low, high))


def _phrased(status: str, said: str, failed: str, bound: str) -> str:
    """A rule's reason as its status reads: the failing wording, or why it could not decide."""
    if status == FAIL:
        return failed
    if status == INCONCLUSIVE:
        return f"inconclusive, because {said}: the interval straddles the {bound}"
    return said
