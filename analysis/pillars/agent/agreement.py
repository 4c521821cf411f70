"""Tool-call agreement of a run with a reference run (`k3load diff A B`, `--k3-reference DIR`).

    profile(attempts)                 -> the reference's behaviour per scenario and turn (JSON-ready)
    agreement(profile, attempts)      -> trigger precision / recall / F1, tool-name agreement, schema
                                         accuracy, structured-output validity, finish-reason mix
    reference_record(DIR)             -> what `reference.json` holds: path, run id, manifest hash, profile
    reference_rules(record, attempts, limits) -> the agent pillar's rules against the reference

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
from pathlib import Path
from typing import Any

from k3load.analysis.pillars.rules import RuleResult
from k3load.analysis.run.clusters import rate_by_request
from k3load.analysis.run.lean import AnyAttempt, call_name, designed_body, first_finding
from k3load.analysis.run.rundata import read_attempts
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


def answered(attempt: AnyAttempt) -> bool:
    return attempt.status == "ok" and not attempt.drill and designed_body(attempt)


def triggered(attempt: AnyAttempt) -> bool:
    return bool(attempt.tool_calls) or attempt.finish_reason == "tool_calls"


def tool_names(attempt: AnyAttempt) -> list[str]:
    """The called tools' names, sorted (a parallel answer's calls as a multiset)."""
    return sorted(call_name(c) for c in attempt.tool_calls)


def schema_ok(attempt: AnyAttempt) -> bool:
    """As the agent pillar counts schema accuracy: no failed `tool_call.*` finding."""
    return findings_schema_ok(attempt.findings)


def findings_schema_ok(findings: Sequence[Finding]) -> bool:
    return not any(not f.ok and f.check.startswith("tool_call.") for f in findings)


def json_valid(attempt: AnyAttempt) -> bool | None:
    """Structured output (`expect.json`) held; None when the turn asked for none."""
    found = first_finding(attempt.findings, "expect.json")
    return None if found is None else found.ok


def _key(scenario: str, turn: int) -> str:
    return f"{scenario}#{turn}"


def _label(answers: int, hits: int) -> str | None:
    if not answers or hits * 2 == answers:
        return None  # never answered, or split evenly: no label
    return TOOL_CALL if hits * 2 > answers else ANSWER


def profile(attempts: list[AnyAttempt]) -> dict[str, Any]:
    """The behaviour of a run per scenario and turn, and its overall rates, as plain JSON data (what
    reference.json keeps, so a run judged against a reference needs only its own directory)."""
    answers = [a for a in attempts if answered(a)]
    turns: dict[str, dict[str, Any]] = {}
    names: dict[str, Counter[tuple[str, ...]]] = {}
    for a in sorted(answers, key=lambda a: (a.scenario, a.turn)):
        row = turns.setdefault(_key(a.scenario, a.turn), {"scenario": a.scenario, "turn": a.turn, "answers": 0,
                                                          "triggered": 0})
        row["answers"] += 1
        if triggered(a):
            row["triggered"] += 1
            names.setdefault(_key(a.scenario, a.turn), Counter())[tuple(tool_names(a))] += 1
    for key, row in turns.items():
        row["label"] = _label(row["answers"], row["triggered"])
        common = sorted((names.get(key) or Counter()).items(), key=lambda kv: (-kv[1], kv[0]))
        row["tool_names"] = list(common[0][0]) if common else None
    calls = [a for a in answers if triggered(a)]
    structured = [v for v in (json_valid(a) for a in answers) if v is not None]
    return {"answers": len(answers), "turns": [turns[k] for k in sorted(turns)],
            "schema": {"k": sum(schema_ok(a) for a in calls), "n": len(calls)},
            "structured_output": {"k": sum(structured), "n": len(structured)},
            "finish_reasons": dict(sorted(Counter(str(a.finish_reason) for a in answers).items()))}


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


def _tally(turns: dict[str, dict[str, Any]], answers: list[AnyAttempt], scored: list[tuple[AnyAttempt, str]]
           ) -> tuple[dict[str, dict[str, Any]], Counter[str], Counter[str], Counter[str]]:
    """Each answer scored against its turn's label: rows per turn, totals (tp/fp/fn/tn, not_comparable),
    the primary layers of the disagreeing answers, and the tool-name checks of the agreeing calls."""
    rows: dict[str, dict[str, Any]] = {}
    totals = Counter[str]()
    layers = Counter[str]()
    names = Counter[str]()
    for a in sorted(answers, key=lambda a: (a.scenario, a.turn)):
        ref = turns.get(_key(a.scenario, a.turn))
        if ref is None or ref["label"] is None:
            totals["not_comparable"] += 1
            continue
        row = rows.setdefault(_key(a.scenario, a.turn), {
            "scenario": a.scenario, "turn": a.turn, "reference_label": ref["label"],
            "reference_triggered": ref["triggered"], "reference_answers": ref["answers"], "answers": 0,
            "triggered": 0, "tp": 0, "fp": 0, "fn": 0, "tn": 0, "names_same": 0, "names_compared": 0})
        hit, want = triggered(a), ref["label"] == TOOL_CALL
        outcome = ("tp" if want else "fp") if hit else ("fn" if want else "tn")
        row["answers"] += 1
        row["triggered"] += hit
        row[outcome] += 1
        totals[outcome] += 1
        scored.append((a, outcome))  # each comparable answer's outcome, for the intervals over distinct requests
        if outcome in ("fp", "fn"):
            layers[a.primary_layer or MODEL_OUTPUT] += 1
        if outcome == "tp" and ref.get("tool_names") is not None:
            same = tool_names(a) == list(ref["tool_names"])
            row["names_same"] += same
            row["names_compared"] += 1
            names["same"] += same
            names["compared"] += 1
    return rows, totals, layers, names


def agreement(reference: dict[str, Any], attempts: list[AnyAttempt]) -> dict[str, Any]:
    """The judged run's answers against the reference profile (module docstring for the definitions)."""
    turns = {_key(t["scenario"], t["turn"]): t for t in reference.get("turns") or []}
    answers = [a for a in attempts if answered(a)]
    scored: list[tuple[AnyAttempt, str]] = []
    rows, totals, layers, _names = _tally(turns, answers, scored)  # names: counted per turn in rows
    tp, fp, fn, tn = (totals[k] for k in ("tp", "fp", "fn", "tn"))
    f1, f1_ci = f1_interval(tp, fp, fn, _among(scored, ("tp", "fp", "fn")))

    def share(among: tuple[str, ...]) -> Rate:  # tp among the answers with these outcomes, by distinct request
        return _among(scored, among) if any(o in among for _, o in scored) else wilson(0, 0)
    for row in rows.values():
        mine = [(a, o) for a, o in scored if a.scenario == row["scenario"] and a.turn == row["turn"]]
        row["recall"] = _among(mine, ("tp", "fn")).to_dict() if row["tp"] + row["fn"] else None
    calls = [a for a in answers if triggered(a)]
    judged = [(a, v) for a, v in ((a, json_valid(a)) for a in answers) if v is not None]
    named = [(a, tool_names(a) == list(want)) for a, o in scored if o == "tp"
             and (want := turns[_key(a.scenario, a.turn)].get("tool_names")) is not None]
    return {
        "comparable": tp + fp + fn + tn, "not_comparable": totals["not_comparable"],
        "trigger": {"tp": tp, "fp": fp, "fn": fn, "tn": tn, "precision": share(("tp", "fp")).to_dict(),
                    "recall": share(("tp", "fn")).to_dict(), "f1": f1, "f1_ci95": list(f1_ci) if f1_ci else None},
        "disagreeing_by_layer": dict(sorted(layers.items())),
        "tool_name_agreement": rate_by_request([a for a, _ in named], [same for _, same in named]).to_dict(),
        "schema_accuracy": _compared(_rate(reference.get("schema")),
                                     rate_by_request(calls, [schema_ok(a) for a in calls])),
        "structured_output_validity": _compared(_rate(reference.get("structured_output")),
                                                rate_by_request([a for a, _ in judged], [v for _, v in judged])),
        "finish_reasons": {"reference": _mix(reference.get("finish_reasons") or {}),
                           "run": _mix(dict(Counter(str(a.finish_reason) for a in answers)))},
        "by_turn": [rows[k] for k in sorted(rows)],
    }


def _among(scored: list[tuple[AnyAttempt, str]], among: tuple[str, ...]) -> Rate:
    """The share of true positives among the answers scored one of `among`, by distinct request."""
    picked = [(a, o) for a, o in scored if o in among]
    return rate_by_request([a for a, _ in picked], [o == "tp" for _, o in picked])


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
        attempts = read_attempts(records)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ReferenceRunError(f"reference {ref_dir}: unreadable ({type(exc).__name__}: {exc})") from None
    found = profile(attempts)
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


def reference_rules(record: dict[str, Any], attempts: list[AnyAttempt], limits: dict[str, float]
                    ) -> tuple[dict[str, Any], list[RuleResult]]:
    """Trigger F1 against `min_reference_trigger_f1` and the schema-accuracy drop against
    `max_reference_schema_accuracy_drop`; inconclusive below `min_reference_attempts` comparable answers."""
    numbers = agreement(record["profile"], attempts)
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
