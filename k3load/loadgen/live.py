"""The run so far, for the web UI: `LiveState(session).state()` is the JSON of `GET /k3load/state`.

    run_id, run_dir     the current run (a new one per test started from the UI)
    error               the harness error that stopped the run before any load (then no verdict), or null
    stage               {name, kind, users, elapsed_s, left_s (null for a manual stage), goodput, goodput_ci95,
                        goodput_requests} or null: goodput is the share of the stage's requests so far that met every
                        SLO (k3load.loadgen.search_live.LiveGoodput, the analysis's own test), with its Wilson interval
    goodput             [{stage, requests, good, goodput, goodput_ci95}] for every stage of the run so far
    search              the last `kind: search` stage's search (k3load.loadgen.search_live.LiveSearch.snapshot:
                        the step, its users and evidence so far, the bracket last_good / first_bad, how it ended)
                        or null
    signals             users, requests_per_s, the current stage's TTFT / ITL / e2e p50 and p95 (ms, from the
                        provisional judgment), kv_usage, running, waiting, preemptions (this run), prefix hit
                        ratio (this run), GPU memory per GPU and node, the load generator's CPU per process,
                        attempts, valid, failures by layer
    pillars             {pillar: {status, reason}}: provisional, by `k3load.analysis.analyze.judge` over the
                        run directory as it is (null before the first judgment); the verdict's once judged
    verdict             null until the run is judged at its stop, then {verdict, because, exit_code, links}
    history             [{ts, users, kv_usage, waiting, running, gpu_memory_used_mib}], one per scrape

Why the same `judge`: a provisional pillar must mean what the final one means. It reads the whole run
directory, so it runs in gevent's native thread pool, at most every `judge_every_s` (and never more
often than 5 times its own last duration), and its result is cached; past `MAX_RECORDS_BYTES` of
records it pauses until the test stops. The scrape lines are read incrementally from metrics.jsonl.gz
(k3load.evidence: whole lines up to the writer's last flush, at most half a second old) and gpu.jsonl.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gevent
from locust.runners import Runner

from k3load.analysis.run.stats import wilson
from k3load.evidence import METRICS, RECORDS, SeriesTable, evidence_file
from k3load.loadgen.tail import Tail
from k3load.sampler.prom import split_key
from k3load.sampler.vllm_metrics import VllmMetric

if TYPE_CHECKING:  # for the annotations only: the analysis loads when the first judgment runs
    from k3load.analysis.analyze import Judgment
    from k3load.loadgen.session import HarnessSession

log = logging.getLogger("k3load")
HISTORY_POINTS = 3600
# The provisional judgment reads the whole run (pandas held 2.27 GB judging an hour of 4 users): past this
# size of records.jsonl.gz (about 64 MiB of JSON lines, compressed about 7 times) it pauses until the test
# stops, rather than spike the load generator's memory every few seconds.
MAX_RECORDS_BYTES = 9 << 20
LINKS = ("report.html", "report.md", "verdict.json", RECORDS, "alerts.yaml", "dashboard.json",
         "validation_summary.json")


def _sum(samples: dict[str, float], name: str) -> float | None:
    values = [v for k, v in samples.items() if split_key(k)[0] == name and v is not None]
    return float(sum(values)) if values else None


def _max(samples: dict[str, float], name: str) -> float | None:
    values = [v for k, v in samples.items() if split_key(k)[0] == name and v is not None]
    return float(max(values)) if values else None


class Signals:
    """The server's and the GPUs' latest readings of one run, from its scrape files."""

    COUNTERS = (VllmMetric.NUM_PREEMPTIONS_TOTAL, VllmMetric.PREFIX_CACHE_HITS_TOTAL,
                VllmMetric.PREFIX_CACHE_QUERIES_TOTAL)

    def __init__(self, run_dir: Path) -> None:
        self.metrics = Tail(run_dir, METRICS, SeriesTable())
        self.gpu = Tail(run_dir, "gpu.jsonl")
        self.latest: dict[str, dict[str, float]] = {}  # source -> samples of its last good scrape
        self.first: dict[str, dict[str, float | None]] = {}  # source -> counters at its first good scrape
        self.gpus: dict[tuple[str, Any], dict[str, Any]] = {}  # (node, gpu) -> last row
        self.history: list[dict[str, Any]] = []

    def update(self, users: int) -> None:
        for row in self.gpu.lines():
            self.gpus[(str(row.get("node") or row.get("source") or ""), row.get("gpu"))] = row
        for line in self.metrics.lines():
            if not line.get("ok"):
                continue
            source, samples = str(line.get("source")), line.get("samples") or {}
            self.latest[source] = samples
            self.first.setdefault(source, {c: _sum(samples, c) for c in self.COUNTERS})
            self.history.append({"ts": line.get("ts"), "users": users, **self._server()})
            if len(self.history) >= 2 * HISTORY_POINTS:  # a page opened hours into a run: never the whole run
                del self.history[:-HISTORY_POINTS]
        del self.history[:-HISTORY_POINTS]

    def _counter_delta(self, name: str) -> float | None:
        deltas = []
        for source, samples in self.latest.items():
            now, then = _sum(samples, name), self.first.get(source, {}).get(name)
            if now is not None and then is not None:
                deltas.append(max(now - then, 0.0))  # a restart's reset reads as no change, never negative
        return sum(deltas) if deltas else None

    def _server(self) -> dict[str, Any]:
        sources = list(self.latest.values())
        kv = [v for s in sources if (v := _max(s, VllmMetric.KV_CACHE_USAGE)) is not None]
        running = [v for s in sources if (v := _sum(s, VllmMetric.NUM_REQUESTS_RUNNING)) is not None]
        waiting = [v for s in sources if (v := _sum(s, VllmMetric.NUM_REQUESTS_WAITING)) is not None]
        used = [v for row in self.gpus.values() if (v := row.get("memory_used_mib")) is not None]
        return {"kv_usage": max(kv) if kv else None, "running": sum(running) if running else None,
                "waiting": sum(waiting) if waiting else None,
                "gpu_memory_used_mib": float(sum(used)) if used else None}

    def snapshot(self) -> dict[str, Any]:
        hits, queries = (self._counter_delta(VllmMetric.PREFIX_CACHE_HITS_TOTAL),
                         self._counter_delta(VllmMetric.PREFIX_CACHE_QUERIES_TOTAL))
        gpus = [{"node": node, "gpu": gpu, "memory_used_mib": row.get("memory_used_mib"),
                 "memory_total_mib": row.get("memory_total_mib"), "simulated": bool(row.get("simulated"))}
                for (node, gpu), row in sorted(self.gpus.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))]
        return {**self._server(), "preemptions": self._counter_delta(VllmMetric.NUM_PREEMPTIONS_TOTAL),
                "prefix_cache_hit_ratio": hits / queries if hits is not None and queries else None, "gpus": gpus}


class LiveState:
    """One per master/local process with a web UI; follows the session's current run."""

    def __init__(self, session: HarnessSession, judge_every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, judge: Callable[[Path], Judgment] | None = None,
                 max_records_bytes: int = MAX_RECORDS_BYTES) -> None:
        self.session, self.judge_every_s, self.clock = session, judge_every_s, clock
        self.max_records_bytes = max_records_bytes
        self._judge = judge
        self._run: tuple[str, Path | None] = ("", None)
        self._run_dir: Path | None = None
        self.signals: Signals | None = None
        self.pillars: dict[str, Any] | None = None
        self.stage_row: dict[str, Any] = {}
        self._judged_at = float("-inf")
        self._judge_cost_s = 0.0
        self._judging: gevent.Greenlet | None = None

    def _follow_run(self) -> Signals | None:
        """A new run (its id: a new test writes into the same directory) starts its reading afresh."""
        run_dir, run = self.session.run_dir, (self.session.run_id, self.session.run_dir)
        if run != self._run and run_dir is not None and _run_id_in(run_dir) not in (None, run[0]):
            return None  # the last run's files are still there, about to be moved aside: not this run's to read
        if run != self._run:
            self._run, self._run_dir, self.signals = run, run_dir, Signals(run_dir) if run_dir else None
            self.pillars, self.stage_row, self._judged_at = None, {}, float("-inf")
        return self.signals

    def state(self) -> dict[str, Any]:
        session, runner = self.session, self.session.env.runner
        signals = self._follow_run()
        users = int(getattr(runner, "user_count", 0) or 0)
        if signals is not None:
            signals.update(users)
            self._maybe_judge()
        return {"run_id": session.run_id or None, "run_dir": str(session.run_dir) if session.run_dir else None,
                "state": getattr(runner, "state", None), "error": session.fatal or None, "stage": self._stage(),
                "signals": {"users": users, "requests_per_s": _requests_per_s(runner),
                            **{k: self.stage_row.get(k) for k in LATENCY_KEYS},
                            **(signals.snapshot() if signals else {}),
                            "load_generator_cpu_pct": _cpu(runner), "attempts": session.live.attempts,
                            "valid": session.live.valid, "failed_by_layer": dict(session.live.failed_by_layer)},
                "pillars": self._pillars(), "verdict": self._verdict(),
                "goodput": [_goodput(name, c.requests, c.good) for name, c in session.goodput.stages.items()],
                "search": session.search.snapshot() if session.search is not None else None,
                "history": signals.history if signals else []}

    def _stage(self) -> dict[str, Any] | None:
        stage = self.session.stage
        if stage is None:
            return None
        elapsed = time.monotonic() - self.session.stage_started
        manual = stage.name.startswith("manual-")
        count = self.session.goodput.of(stage.name)
        good = _goodput(stage.name, count.requests, count.good)
        return {"name": stage.name, "kind": stage.kind, "users": stage.users, "elapsed_s": round(elapsed, 1),
                "left_s": None if manual else round(max(stage.duration_s - elapsed, 0.0), 1),
                "goodput": good["goodput"], "goodput_ci95": good["goodput_ci95"], "goodput_requests": count.requests}

    def _pillars(self) -> dict[str, Any] | None:
        """Provisional while the run goes on; once judged, the verdict's own."""
        judgment = self.session.judgment
        if self._verdict() is None or judgment is None:
            return self.pillars
        return _pillar_summary(judgment.pillars)

    def _verdict(self) -> dict[str, Any] | None:
        judgment, session = self.session.judgment, self.session
        if judgment is None or not session.finished or session.run_dir is None:
            return None
        return {"verdict": judgment.verdict, "because": judgment.because, "exit_code": judgment.exit_code,
                "links": {name: f"/k3load/run/{name}" for name in LINKS if (session.run_dir / name).exists()}}

    def _maybe_judge(self) -> None:
        now = self.clock()
        every = max(self.judge_every_s, 5 * self._judge_cost_s)
        if self._judging is not None or now - self._judged_at < every or self.session.finished:
            return
        if _size(self._run_dir, RECORDS) > self.max_records_bytes:  # judging it would cost GBs each time
            self.pillars = {"all": {"status": "paused", "reason": f"{RECORDS} over "
                                    f"{self.max_records_bytes >> 20} MiB: judged when the test stops"}}
            return
        self._judged_at = now
        self._judging = gevent.spawn(self._judge_now, self._run_dir)

    def _judge_now(self, run_dir: Path) -> None:
        started, run = time.monotonic(), self._run
        try:
            pillars, row = gevent.get_hub().threadpool.apply(_provisional, (run_dir, self._judge,
                                                                            self.session.stage_name))
            if run == self._run:
                self.pillars, self.stage_row = pillars, row
        except Exception as exc:  # a judgment of a half-written run must never take the UI down
            log.warning("k3load: provisional judgment failed: %s", exc)
        finally:
            self._judge_cost_s = time.monotonic() - started
            self._judging = None


LATENCY_KEYS = ("ttft_p50_ms", "ttft_p95_ms", "ttfa_p50_ms", "ttfa_p95_ms", "itl_p50_ms", "itl_p95_ms", "e2e_p50_ms",
                "e2e_p95_ms")


def _provisional(run_dir: Path, judge: Callable[[Path], Judgment] | None, stage: str
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The final analysis's own functions over the run directory as it is now (nothing written)."""
    if judge is None:
        from k3load.analysis import analyze  # the final analysis, loaded where a run is judged
        judge = analyze.judge
    judgment = judge(run_dir)
    row = next((r.to_dict() for r in judgment.stage_table if r.stage == stage), {})  # plain, as the page shows it
    return _pillar_summary(judgment.pillars), row


def _goodput(stage: str, requests: int, good: int) -> dict[str, Any]:
    """A stage's goodput so far: the share of its requests that met every SLO, with its Wilson 95% interval."""
    rate = wilson(good, requests)
    return {"stage": stage, "requests": requests, "good": good, "goodput": rate.value,
            "goodput_ci95": [rate.low, rate.high] if requests else None}


def _pillar_summary(pillars: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {name: {"status": p.status, "reason": p.reasons[0] if p.reasons else ""} for name, p in pillars.items()}


def _run_id_in(run_dir: Path) -> str | None:
    """The run id in the directory's run.json, None without one. A test started again from the web UI takes the
    new run id a moment before the last run's files are moved aside: until then they are not the new run's."""
    try:
        return json.loads((run_dir / "run.json").read_text(encoding="utf-8")).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def _size(run_dir: Path | None, name: str) -> int:
    try:
        return evidence_file(run_dir, name).stat().st_size if run_dir else 0
    except OSError:
        return 0


def _requests_per_s(runner: Runner | None) -> float | None:
    """Attempts per second now: the `FAMILY: e2e` entries (ttft/itl entries would count them thrice)."""
    stats = getattr(runner, "stats", None)
    if stats is None:
        return None
    return round(sum(e.current_rps for (name, _), e in stats.entries.items() if name.endswith(": e2e")), 2)


def _cpu(runner: Runner | None) -> dict[str, float | None]:
    clients = getattr(runner, "clients", None)
    if clients is not None:  # a master: each worker's own report
        return {str(w.id): w.cpu_usage for w in clients.values()}
    return {"local": getattr(runner, "current_cpu_usage", None)}
