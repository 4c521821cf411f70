"""`k3load diff A B [--json]`: run B judged against reference run A, so CI can gate a new deployment.

    k3load diff runs/accepted runs/candidate          # Markdown-ish tables
    k3load diff runs/accepted runs/candidate --json   # one JSON object

What it compares: the two verdicts, pillar statuses and limits side by side; per stage (matched by
name) throughput and TTFT / TTFA (first answer token, after the reasoning) / ITL / e2e p50 and p95 with
95% intervals and a "changed beyond noise" flag; per scenario and turn, with A as the reference, tool-call
trigger precision / recall / F1, tool-name agreement, argument schema accuracy, structured-output
validity and the finish-reason mix (analysis/pillars/agent/agreement.py defines each). Exit code 0 when no rule
shows B worse than A beyond the thresholds of B's plan (`thresholds.diff`, defaults in
analysis/pillars/pillar.py), DIFF_WORSE_EXIT when one does, 2 for input that is not two run directories with
records.

Why these intervals. A percentile's interval is the distribution-free order-statistic interval: the
sorted values between which the true percentile lies with 95% probability, from the binomial count of
values below it. It is what a percentile bootstrap of the stage's records approximates by resampling,
but exact, instant and the same bytes on every machine. It counts the values as independent draws, and
answers sent close together are not: a hiccup of the server or the machine slows every answer in flight
(CI's healthy pair, stop 47: six of B's seven slowest TTFTs of the 2-s c6 step were sent within 90 ms,
and its p95 interval lay above A's on the same sim). So each latency's interval is the one of the
effective number of draws, the values over their design effect (`design_effect`: how much more the share
under the percentile varies between the stage's send windows, each as wide as its median answer, than
between independent draws; Woodruff's interval under clustering), its ranks scaled back to the values:
never narrower than the independent one, the same where the windows show no clustering.

Throughput (answered requests per second and output tokens per second of the stage) is a compound count:
what the stage samples is sessions, each bringing its own number of answers and each answer its own tokens
(a timeout-retry drill's session answers twice in a second, a multi-tool session eight times; a tool call is
20 tokens, prose ten times more), so the variance of the stage's total is the sum over its sessions of their
squared totals, not the answers' count times the mean squared. Each gets the Poisson score interval of the
answers' count, its half-width widened by sqrt(n * sum(session total^2)) / total (`spread_factor`; 1 for
single answers of equal size; a record without a session is a session of its own). Why: CI's healthy pair
(stop 46) drew its two c2 users into timeout-retry sessions in A and not in B, 34 answers against 63 in the
same 2 s, and the answers-as-independent interval called it a change beyond noise; by sessions it is not.
"Changed beyond noise" means the two 95% intervals do not overlap: a conservative two-sample test (for
equal widths it rejects at about p < 0.006), chosen because dozens of figures are compared at once and
a flag should mean something; and the figure moved by at least the plan's `min_relative_change`,
because within-run intervals cannot see run-to-run variation (another tenant on the host, a different
warm-up): two healthy runs side by side differ by a few milliseconds beyond their intervals. A latency
also has to move by at least `min_latency_change_ms` (5 ms): on a fast server (the sim's TTFT is 4 ms)
a 30% move is 1 ms, the jitter of the client machine's scheduler, not the deployment's. A gating
rule fails only when B is worse beyond the plan's margin AND beyond noise (latencies: by at least that
floor too); inconclusive rules are printed but never gate (too little evidence is not a regression).

Why a starved load generator leaves its stage unjudged. The client's share of each figure is its own:
a latency holds the time the load generator waited for a CPU before reading the answer, and a closed
loop that waits sends less. Each run records that wait (k3load.sampler.cpu_wait, the kernel's run-queue
time of the process). A stage where either run's load generator waited more than the plan's
`max_load_generator_cpu_wait` share of its wall time (mean over the stage, the most-waiting process) keeps
its figures and intervals, but no flag and no pass or fail: its rules are inconclusive, saying whose wait
and how much. Why: the healthy pair of tests/sim/test_diff.py run with six busy loops beside it on two cores
(its load generator waiting 28-52% of each stage) moved its load stage's TTFT p50 from 15 to 67 ms, intervals
apart, on the same sim; run quiet (waiting 4-8%), nothing moved.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from k3load.analysis.pillars.agent.agreement import agreement, profile
from k3load.analysis.pillars.headroom.stages import cpu_wait_in
from k3load.analysis.pillars.pillar import percentile, rounded, thresholds
from k3load.analysis.pillars.rules import RuleResult
from k3load.analysis.run.stats import Z95, Rate, decide_rate
from k3load.errors import InputError
from k3load.evidence import records_file
from k3load.outcomes import FAIL, INCONCLUSIVE, PASS

if TYPE_CHECKING:  # pandas is imported only when a diff runs, not by every `k3load` command
    from k3load.analysis.run.record_columns import Rows
    from k3load.analysis.run.rundata import RunData

DIFF_WORSE_EXIT = 6  # B worse than A beyond the plan's thresholds (the verdict codes are 0, 3, 4, 5; errors 2)
CPU_WAIT = "load_generator_cpu_wait_pct"  # a stage's most-waiting load-generator process, mean % of wall time
CPU_WAIT_EVIDENCE = ("metrics.jsonl load_generator_cpu_wait_pct", "events.jsonl load_generator_cpu cpu_wait_pct")
LATENCIES = (("ttft_ms", "ttft"), ("ttfa_ms", "ttfa"), ("itl_mean_ms", "itl"), ("e2e_ms", "e2e"))
QUANTILES = (0.5, 0.95)


class DiffInputError(InputError):
    """Not a run directory with records: said with the path, exit 2."""


@dataclass
class Side:
    """One run as the diff reads it: its data and its verdict (verdict.json, or judged now when absent)."""

    data: RunData
    verdict: dict[str, Any]
    judged_now: bool


def load_side(path: Path) -> Side:
    from k3load.analysis.cli import run_dir_problem
    from k3load.analysis.run.rundata import load_run

    if problem := run_dir_problem(path):  # the one check analyze and verify make too
        raise DiffInputError(problem)
    if not records_file(path).is_file():
        raise DiffInputError(f"{path}: no records.jsonl.gz (not a run directory, or the run never sent a request)")
    data = load_run(path)
    if not len(data.columns):
        raise DiffInputError(f"{path}: records.jsonl holds no attempt")
    if (path / "verdict.json").is_file():
        return Side(data, json.loads((path / "verdict.json").read_text()), False)
    from k3load.analysis.analyze import judge  # only when the run was never judged: judged now, not written

    return Side(data, judge(path).verdict_json(), True)


# -- per stage -----------------------------------------------------------------------------------------

def _order_ranks(n: int, q: float) -> tuple[int, int]:
    """The 1-based ranks (r, s) of n sorted draws between which the q-quantile lies with 95% probability."""
    log_q, log_p = math.log(q), math.log1p(-q)
    cdf, cumulative = [], 0.0
    for k in range(n + 1):
        cumulative += math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                               + k * log_q + (n - k) * log_p)
        cdf.append(cumulative)
    r = max([k + 1 for k in range(n + 1) if cdf[k] <= 0.025], default=0)  # P(B < r) <= 2.5%
    s = min([k + 1 for k in range(n + 1) if cdf[k] >= 0.975], default=n)  # P(B >= s) <= 2.5%
    return max(r, 1), min(s, n)


def design_effect(values: np.ndarray, estimate: float, groups: np.ndarray) -> float:
    """How much more the share of values at or under `estimate` varies when the values come in groups than
    if each were drawn alone: the groups' (cluster-robust) variance of that share over the binomial one,
    never under 1; 1 where it cannot be told (one group, or every value on one side)."""
    n = len(values)
    below = (values <= estimate).astype(float)
    share = float(below.mean()) if n else 0.0
    codes = np.unique(groups, return_inverse=True)[1] if n else groups
    count = int(codes.max()) + 1 if n else 0
    if count < 2 or share in (0.0, 1.0):
        return 1.0
    spread = np.bincount(codes, weights=below) - share * np.bincount(codes)
    clustered = float(np.square(spread).sum()) / n ** 2  # values each alone: exactly share * (1 - share) / n
    return max(clustered / (share * (1 - share) / n), 1.0)


def quantile_interval(values: list[float], q: float, groups: np.ndarray | None = None
                      ) -> tuple[float, float] | None:
    """The 95% order-statistic interval of the q-quantile (module docstring); None under 2 values. With
    `groups` (each value's send window), the interval of the effective number of draws, n over the design
    effect (Woodruff's interval under clustering), its ranks scaled back to the n values; never narrower
    than the interval of n independent draws, and exactly it where the groups show no clustering."""
    xs = sorted(values)
    n = len(xs)
    if n < 2:
        return None
    r, s = _order_ranks(n, q)
    estimate = percentile(values, q)  # a number: the values are at least two
    if groups is not None and estimate is not None:
        deff = design_effect(np.asarray(values, dtype=float), estimate, groups)
        m = max(int(n / deff + 1e-9), 2)  # the rounding of a design effect of 1 leaves n
        if m < n:
            rm, sm = _order_ranks(m, q)
            r, s = min(r, (rm - 1) * n // m + 1), max(s, min(n, -(-sm * n // m)))
    return xs[r - 1], xs[s - 1]


def poisson_interval(count: int, duration_s: float, spread: float = 1.0, scale: float = 1.0
                     ) -> tuple[float, float] | None:
    """95% score interval of a rate from a count over a duration; its half-width times `spread` (the
    clustering's, `spread_factor`) and the whole times `scale` (tokens per answer)."""
    if duration_s <= 0:
        return None
    half = Z95 * math.sqrt(count + Z95 * Z95 / 4) * spread
    centre = count + Z95 * Z95 / 2
    return max(centre - half, 0.0) * scale / duration_s, (centre + half) * scale / duration_s


def spread_factor(values: np.ndarray, groups: np.ndarray) -> float:
    """The factor a count's interval widens by when the items of a sum come in groups (a session's answers):
    the compound Poisson standard deviation sqrt(sum over groups of (group sum)^2) against sqrt(n) times the
    mean item, i.e. sqrt(n * sum(g^2)) / total. 1 for single items of equal value; never under 1 for
    non-negative values (Cauchy-Schwarz: total^2 <= groups * sum(g^2) <= n * sum(g^2))."""
    total = float(values.sum())
    if total <= 0 or not len(values):
        return 1.0
    sums = np.bincount(groups, weights=values) if len(groups) else values
    return math.sqrt(len(values) * float(np.square(sums).sum())) / total


def _figure(value: float | None, interval: tuple[float, float] | None) -> dict[str, Any]:
    return {"value": value, "ci95": list(interval) if interval else None}


def send_windows(ok: Rows) -> np.ndarray:
    """Each answer's window of the stage by its send time, a window as wide as the stage's median answer
    (e2e; 1 ms at least): answers sent within one answer's time of each other met the same server and the
    same machine, a hiccup slowing all of them (CI's healthy pair, stop 47: six of B's seven slowest c6 TTFTs
    sent within 90 ms)."""
    send = ok.number("send_ts")
    e2e = ok.number("e2e_ms")
    known = e2e[~np.isnan(e2e)]
    width = max(float(np.median(known)) / 1000 if len(known) else 0.0, 1e-3)
    start = float(np.nanmin(send)) if len(send) and not np.isnan(send).all() else 0.0
    return np.nan_to_num(np.floor((send - start) / width), nan=-1.0).astype(np.int64)


def stage_figures(data: RunData) -> dict[str, dict[str, Any]]:
    """Per stage name: answered requests/s and output tokens/s, latency p50/p95, each with its interval."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(s.name for s in data.stages):
        windows = [(s.start_ts, s.end_ts) for s in data.stages if s.name == name]
        duration = sum(t1 - t0 for t0, t1 in windows)
        mine = data.columns.rows(name)
        ok = mine[~mine.flag("drill") & mine.code_is("status", "ok")]
        sessions = ok.groups("session_id")
        rps = poisson_interval(len(ok), duration, spread_factor(np.ones(len(ok)), sessions))
        per_answer = np.nan_to_num(ok.number("completion_tokens"), nan=0.0)
        tokens = float(per_answer.sum())
        figures = {"answers": len(ok), "duration_s": duration, CPU_WAIT: cpu_wait_in(data, windows),
                   "requests_per_s": _figure(len(ok) / duration if duration > 0 else None, rps),
                   "output_tokens_per_s": _figure(tokens / duration if duration > 0 else None, poisson_interval(
                       len(ok), duration, spread_factor(per_answer, sessions), tokens / len(ok) if len(ok) else 0.0))}
        windows_of = send_windows(ok)
        for column, label in LATENCIES:
            known = ok.number(column)
            values = known[~np.isnan(known)].tolist()
            groups = windows_of[~np.isnan(known)]
            for q in QUANTILES:
                figures[f"{label}_p{round(q * 100)}_ms"] = _figure(percentile(values, q),
                                                                  quantile_interval(values, q, groups))
        out[name] = figures
    return out


MEASURES = ("requests_per_s", "output_tokens_per_s", *(f"{label}_p{round(q * 100)}_ms" for _, label in LATENCIES
                                                        for q in QUANTILES))


def changed(a: dict[str, Any], b: dict[str, Any], min_relative: float = 0.0, min_absolute: float = 0.0
            ) -> str | None:
    """'higher' / 'lower' when B's interval lies wholly above / below A's and B moved by at least
    `min_relative` of A's value and at least `min_absolute`; None when they overlap, the move is smaller,
    or a figure is missing."""
    if not a["ci95"] or not b["ci95"] or not a["value"] or b["value"] is None:
        return None
    if abs(b["value"] - a["value"]) < max(min_relative * abs(a["value"]), min_absolute):
        return None
    if b["ci95"][0] > a["ci95"][1]:
        return "higher"
    if b["ci95"][1] < a["ci95"][0]:
        return "lower"
    return None


def starved_by(waits: dict[str, float | None], most: float) -> str | None:
    """Why a stage is not judged: each run whose load generator waited for a CPU more than `most` (a share)
    of the stage, with its wait; None when neither did or neither recorded it."""
    over = [f"{pct:g}% in {side.upper()}" for side, pct in waits.items() if pct is not None and pct > most * 100]
    if not over:
        return None
    return (f"the load generator was short of CPU (it waited for one {' and '.join(over)} of the stage's wall time, "
            f"more than {most:.0%}): its latencies and its closed loop's rate are the host's as much as the server's")


def compare_stages(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]], min_relative: float = 0.0,
                   min_latency_ms: float = 0.0, max_cpu_wait: float = 1.0) -> list[dict[str, Any]]:
    """Per stage in both runs, each measure of both with its flag (latencies: `min_latency_ms` at least);
    none where a load generator waited for a CPU more than `max_cpu_wait` of the stage (`starved`)."""
    rows = []
    for name in [*a, *(n for n in b if n not in a)]:
        row: dict[str, Any] = {"stage": name, "in": "both" if name in a and name in b else "a" if name in a else "b"}
        if row["in"] == "both":
            row["answers"] = {"a": a[name]["answers"], "b": b[name]["answers"]}
            waits = {"a": a[name].get(CPU_WAIT), "b": b[name].get(CPU_WAIT)}
            row[CPU_WAIT], row["starved"] = waits, starved_by(waits, max_cpu_wait)
            row["measures"] = {m: {"a": a[name][m], "b": b[name][m],
                                   "changed_beyond_noise": None if row["starved"] else
                                   changed(a[name][m], b[name][m], min_relative,
                                           min_latency_ms if m.endswith("_ms") else 0.0)}
                               for m in MEASURES}
        rows.append(row)
    return rows


def _stage_rules(stages: list[dict[str, Any]], limits: dict[str, float]) -> list[RuleResult]:
    """Per stage in both runs: p95 latencies up by more than the margin beyond noise, throughput down."""
    rules = []
    up, down, floor = limits["max_latency_p95_increase"], limits["max_throughput_drop"], limits["min_latency_change_ms"]
    for row in (r for r in stages if r["in"] == "both"):
        if row["starved"]:
            rules.append(RuleResult(f"diff.stage.{row['stage']}", "diff", INCONCLUSIVE, f"{row['stage']}: latencies "
                                    f"and throughput inconclusive, because {row['starved']}",
                                    max(v for v in row[CPU_WAIT].values() if v is not None),
                                    limits["max_load_generator_cpu_wait"] * 100, evidence=CPU_WAIT_EVIDENCE))
            continue
        for measure, figures in row["measures"].items():
            a, b = figures["a"], figures["b"]
            latency = measure.endswith("_p95_ms")
            if not latency and not measure.endswith("_per_s"):
                continue
            rule_id = f"diff.{'latency' if latency else 'throughput'}.{row['stage']}.{measure}"
            if a["value"] is None and b["value"] is None and measure.startswith("ttfa"):
                continue  # no answer token timed in either run (not streamed, or recorded before TTFA was)
            if not a["ci95"] or not b["ci95"]:
                rules.append(RuleResult(rule_id, "diff", INCONCLUSIVE, f"{row['stage']} {measure}: inconclusive, "
                                        "because a run has fewer than 2 answers in the stage", evidence=("records",)))
                continue
            if latency:
                worse = b["ci95"][0] > max(a["ci95"][1] * (1 + up), a["ci95"][1] + floor)
            else:
                worse = b["ci95"][1] < a["ci95"][0] * (1 - down)
            margin = f"+{up:.0%} (at least {floor:g} ms)" if latency else f"-{down:.0%}"
            rules.append(RuleResult(
                rule_id, "diff", FAIL if worse else PASS,
                f"{row['stage']} {measure}: A {_ci(a)}, B {_ci(b)} ({'beyond' if worse else 'within'} {margin} of A "
                "and noise)", b["value"], a["value"], evidence=("records.jsonl", "events.jsonl stage windows"),
                interval=tuple(b["ci95"])))
    return rules


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:g}"


def _ci(figure: dict[str, Any]) -> str:
    if figure["value"] is None:
        return "–"
    text = f"{figure['value']:.3g}"
    return text + (f" [{figure['ci95'][0]:.3g}, {figure['ci95'][1]:.3g}]" if figure["ci95"] else "")


# -- agreement rules -----------------------------------------------------------------------------------

def _agreement_rules(n: dict[str, Any], limits: dict[str, float]) -> list[RuleResult]:
    need = int(limits["min_comparable_attempts"])
    evidence = ("A records.jsonl (labels)", "B records.jsonl (predictions)")
    if n["comparable"] < need:
        return [RuleResult("diff.agreement", "diff", INCONCLUSIVE, f"tool-call agreement inconclusive, because only "
                           f"{n['comparable']} of B's answers are comparable with A (at least {need} are needed)",
                           n["comparable"], need, evidence=evidence)]
    trig, rules = n["trigger"], []
    if trig["f1"] is None:
        rules.append(RuleResult("diff.trigger_f1", "diff", INCONCLUSIVE, "trigger F1 inconclusive, because neither "
                                "run called a tool on a comparable turn", evidence=evidence))
    else:
        low, high = trig["f1_ci95"]
        floor = limits["min_trigger_f1"]
        status = PASS if low >= floor else FAIL if high < floor else INCONCLUSIVE
        recall = trig["recall"]
        rules.append(RuleResult("diff.trigger_f1", "diff", status, f"trigger F1 {trig['f1']:.3f} [{low:.3f}, "
                                f"{high:.3f}] against {floor:g} required; recall {_rate(recall)} ({trig['fn']} of A's "
                                f"tool calls answered without one), precision {_rate(trig['precision'])}",
                                trig["f1"], floor, evidence=evidence, interval=(low, high)))
    names = n["tool_name_agreement"]
    floor = limits["min_tool_name_agreement"]
    status = decide_rate(Rate.from_dict(names), floor) if names["n"] else INCONCLUSIVE  # by distinct request
    rules.append(RuleResult("diff.tool_name_agreement", "diff", status, f"tool-name agreement {_rate(names)} against "
                            f"{floor:.0%} required" + ("" if names["n"] else ": inconclusive, because no tool call "
                                                       "of B's met one of A's"), names["rate"], floor,
                            evidence=evidence))
    for key, limit_key in (("schema_accuracy", "max_schema_accuracy_drop"),
                           ("structured_output_validity", "max_structured_output_drop")):
        rules.append(_drop_rule(key, n[key], limits[limit_key]))
    return rules


def _drop_rule(key: str, compared: dict[str, Any], limit: float) -> RuleResult:
    label = key.replace("_", " ")
    if compared["drop"] is None:
        return RuleResult(f"diff.{key}", "diff", INCONCLUSIVE, f"{label} inconclusive, because "
                          f"{'A' if not compared['reference']['n'] else 'B'} has no answer to judge it on",
                          None, limit)
    low, high = compared["drop_ci95"]
    status = FAIL if low > limit else PASS if high <= limit else INCONCLUSIVE
    text = (f"{label}: A {_rate(compared['reference'])}, B {_rate(compared['run'])}, drop {compared['drop']:+.1%} "
            f"[{low:+.1%}, {high:+.1%}] against at most {limit:.0%}")
    if status == INCONCLUSIVE:
        text = f"{label} inconclusive, because the drop's interval straddles the limit: {text}"
    return RuleResult(f"diff.{key}", "diff", status, text, compared["drop"], limit, interval=(low, high))


def _rate(rate: dict[str, Any]) -> str:
    if not rate["n"]:
        return "– of 0"
    distinct = rate.get("distinct_requests")
    of = f"{distinct} distinct requests, {rate['n']} answers" if distinct is not None else str(rate["n"])
    return f"{rate['rate']:.1%} [{rate['ci95'][0]:.1%}, {rate['ci95'][1]:.1%}] of {of}"


# -- the whole comparison ------------------------------------------------------------------------------

def _identity(side: Side) -> dict[str, Any]:
    return {"path": str(side.data.path), "run_id": side.data.run.get("run_id"),
            "plan": side.data.run.get("plan"), "judged_now": side.judged_now}


def diff(a_dir: Path, b_dir: Path) -> dict[str, Any]:
    """The comparison as one JSON-ready object; `exit_code` says whether B regressed."""
    a, b = load_side(a_dir), load_side(b_dir)
    limits = thresholds(b.data.plan.thresholds if b.data.plan else None)["diff"]
    pillars = sorted(set(a.verdict.get("pillars") or {}) | set(b.verdict.get("pillars") or {}))
    limit_keys = sorted(set(a.verdict.get("limits") or {}) | set(b.verdict.get("limits") or {}))
    stages = compare_stages(stage_figures(a.data), stage_figures(b.data), limits["min_relative_change"],
                            limits["min_latency_change_ms"], limits["max_load_generator_cpu_wait"])
    agreed = agreement(profile(a.data.columns.rows()), b.data.columns.rows())
    rules = _agreement_rules(agreed, limits) + _stage_rules(stages, limits)
    failed = [r for r in rules if r.status == FAIL]
    return rounded({
        "a": _identity(a), "b": _identity(b),
        "verdicts": {"a": a.verdict.get("verdict"), "b": b.verdict.get("verdict")},
        "pillars": {p: {"a": ((a.verdict.get("pillars") or {}).get(p) or {}).get("status"),
                        "b": ((b.verdict.get("pillars") or {}).get(p) or {}).get("status")} for p in pillars},
        "limits": {k: {"a": (a.verdict.get("limits") or {}).get(k), "b": (b.verdict.get("limits") or {}).get(k)}
                   for k in limit_keys},
        "stages": stages, "agreement": agreed, "thresholds": limits,
        "rules": [r.to_dict() for r in rules], "worse": [r.reason for r in failed],
        "inconclusive": [r.reason for r in rules if r.status == INCONCLUSIVE],
        "exit_code": DIFF_WORSE_EXIT if failed else 0,
    })


# -- output --------------------------------------------------------------------------------------------

def render_text(result: dict[str, Any]) -> str:
    """Markdown-ish tables, in the order a reviewer reads: the outcome, what moved, then why."""
    from k3load.analysis.outputs.markdown import table
    from k3load.analysis.outputs.report_reference import finish_rows, summary_rows, turn_rows

    a, b = result["a"], result["b"]
    worse = result["worse"]
    out = [f"# k3load diff: B `{b['run_id']}` against A `{a['run_id']}`\n",
           (f"**B is worse than A beyond the plan's thresholds (exit {result['exit_code']}):**\n\n"
            + "".join(f"- {w}\n" for w in worse)) if worse else
           "**No regression of B beyond the plan's thresholds and noise (exit 0).**\n"]
    if result["inconclusive"]:
        out.append("Inconclusive (not gating):\n\n" + "".join(f"- {w}\n" for w in result["inconclusive"]))
    rows = [{"": "verdict", "A": result["verdicts"]["a"], "B": result["verdicts"]["b"]}]
    rows += [{"": f"pillar {p}", "A": v["a"], "B": v["b"]} for p, v in result["pillars"].items()]
    rows += [{"": f"limit {k}", "A": v["a"], "B": v["b"]} for k, v in result["limits"].items()]
    out.append("## Verdicts, pillars and limits\n\n" + table(rows, ("", "A", "B")))
    stage_rows = []
    for row in result["stages"]:
        if row["in"] != "both":
            stage_rows.append({"stage": row["stage"], "measure": f"only in {row['in'].upper()}"})
            continue
        unjudged = "not judged: short of CPU" if row["starved"] else ""
        waits = row.get(CPU_WAIT) or {}
        if any(v is not None for v in waits.values()):
            stage_rows.append({"stage": row["stage"], "measure": "load generator CPU wait %",
                               "A": _pct(waits.get("a")), "B": _pct(waits.get("b")), "changed beyond noise": ""})
        stage_rows += [{"stage": row["stage"], "measure": m, "A": _ci(f["a"]), "B": _ci(f["b"]),
                        "changed beyond noise": f["changed_beyond_noise"] or unjudged}
                       for m, f in row["measures"].items()]
    floor, latency_floor = result["thresholds"]["min_relative_change"], result["thresholds"]["min_latency_change_ms"]
    out.append(f"## Stages (95% intervals; changed beyond noise: the intervals do not overlap and the figure "
               f"moved by at least {floor:.0%}, a latency by at least {latency_floor:g} ms)\n\n"
               + table(stage_rows, ("stage", "measure", "A", "B", "changed beyond noise")))
    n = result["agreement"]
    out.append(f"## Tool calls, A as the reference\n\n{n['comparable']} of B's answers compared by scenario and turn "
               f"(A's majority behaviour as the label); {n['not_comparable']} not comparable.\n\n"
               + table(summary_rows(n), ("measure", "run", "reference", "drop")).replace(
                   "| measure | run | reference | drop |", "| measure | B | A | drop (A - B) |")
               + "\n" + table(turn_rows(n["by_turn"]), ("scenario", "turn", "reference_label", "reference_calls",
                                                        "answers", "triggered", "tp", "fp", "fn", "recall"))
               + "\n" + table(finish_rows(n["finish_reasons"]), ("finish_reason", "reference", "run"))
               .replace("| finish_reason | reference | run |", "| finish_reason | A | B |"))
    return "\n".join(out)


def add_arguments(parser: Any) -> None:
    parser.add_argument("a", type=Path, metavar="A", help="the reference run directory (the one trusted)")
    parser.add_argument("b", type=Path, metavar="B",
                        help="the run judged against it (its plan's thresholds.diff apply)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: Any) -> int:
    import sys

    try:
        result = diff(args.a, args.b)
    except DiffInputError as exc:
        print(f"k3load diff: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, sort_keys=True, ensure_ascii=False) if args.json else render_text(result))
    return int(result["exit_code"])
