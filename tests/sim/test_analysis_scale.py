"""Analysis at scale judges exactly as the straightforward path does (issue 16, item 4).

Why: the loader (lean records, streamed), the bootstrap (shared picks, threads), the reuse replay
(cached maxima) and the percentile (selection) were rewritten for an hour's soak (360,000 records), and
a verdict is a pure function of the run directory: the same files must give the same verdict.json byte
for byte. The reference path is the code as first written, kept here: whole `Attempt`s and the columns taken
from them, `ratio_ci` per interval, every request compared with every variant, a sorted pick, every
/metrics query a walk over the whole run. It runs
in the same tree, so a change elsewhere that alters verdicts on purpose moves both sides alike.
`tests/data/scale-run` is a small acceptance run against the sim (743 records: control pairs, a
streaming drill, drains, reuse design); it is judged as stored and multiplied four times by
`bench/analysis_scale.py`. No timing here: the bench prints time and memory against the commit before.
The record loader's own checks (lean records, torn lines, the decoder) are in test_analysis_scale_records.py;
the stored run and the whole-Attempt loading both files compare with are in tests/sim/scale_run.py.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pandas as pd
import pytest

from k3load.analysis.analyze import analyze
from k3load.analysis.outputs import manifest
from k3load.analysis.outputs.manifest import verify
from k3load.analysis.pillars.cache.reuse_replay import Geometry, designed_tokens
from k3load.analysis.pillars.pillar import percentile, percentiles
from k3load.analysis.run import rundata
from k3load.analysis.run.record_columns import RecordColumns, Rows, in_send_order
from k3load.analysis.run.rundata import columns_of
from k3load.analysis.run.stats import NORMAL_RATIO_FROM, ratio_ci, ratio_cis, ratio_normal_ci
from k3load.analysis.run.timeline import MetricIndex
from k3load.records import Attempt
from k3load.sampler.prom import split_key
from tests.sim.scale_run import ROOT, _attempts_frame, _unpack


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("analysis_scale", ROOT / "bench" / "analysis_scale.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _verdicts(run: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, bytes]:
    """verdict.json as judged now, and as judged by the straightforward path."""
    analyze(run)
    now = (run / "verdict.json").read_bytes()
    with monkeypatch.context() as patch:
        whole: list[Any] = []

        def load_whole(path: Path) -> rundata.RunData:
            data = load_run(path)
            data.attempts, data.columns = _attempts_frame(path)  # type: ignore[assignment]
            whole[:] = data.attempts
            return data

        def replay_whole(rows: Rows, design: dict[str, Any], geometry: Geometry) -> list[Any]:
            """The straightforward replay over every attempt read whole (reuse passes every row)."""
            assert len(rows) == len(whole)
            found = _replay(whole, design, geometry)
            return [found.get(a.attempt_id) for a in whole]

        load_run = rundata.load_run
        patch.setattr("k3load.analysis.analyze.load_run", load_whole)
        patch.setattr("k3load.analysis.pillars.cache.reuse.designed_tokens", replay_whole)
        patch.setattr("k3load.analysis.pillars.cache.reuse.ratio_cis",
                      lambda num, dens: [ratio_ci(num, d) for d in dens])
        for module in ("pillars.headroom.stages", "pillars.agent.tool_calls"):
            patch.setattr(f"k3load.analysis.{module}.percentiles",
                          lambda values, qs: [_sorted_percentile(values, q) for q in qs])
        index_init = MetricIndex.__init__

        def walking(self: MetricIndex, lines: list[dict[str, Any]]) -> None:
            """Every query walks the whole run, over each scrape's (key, value) rows, as first written."""
            if "_times" in self.__dict__:
                return
            index_init(self, lines)
            self._times = {}

        def total(self: MetricIndex, scrape: Any, name: str, match: dict[str, str] | None) -> float | None:
            """The series' keys parsed again, in the scrape's order: not the layout's grouping of them."""
            layout = scrape.layout
            rows = [(split_key(key)[1], value) for key, value in
                    zip(layout.keys, layout.in_scrape_order(scrape.floats), strict=True) if split_key(key)[0] == name]
            if not rows:
                return None
            return sum(v for labels, v in rows if not match or match.items() <= labels.items())

        patch.setattr(MetricIndex, "__init__", walking)
        patch.setattr(MetricIndex, "_total", total)
        analyze(run)
    return now, (run / "verdict.json").read_bytes()


def test_small_run_is_judged_as_by_the_straightforward_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    run = _unpack(tmp_path / "run")
    now, reference = _verdicts(run, monkeypatch)
    judged = json.loads(now)  # every pillar passes; the run had no restart stage, so the seed is not all proven
    assert judged["verdict"] == "limited" and {p["status"] for p in judged["pillars"].values()} == {"pass"}
    assert judged["next_action"]["because"][0].startswith("not proven: Restart check")
    assert now == reference
    assert verify(run) == []  # the inputs hashed while judging: the manifest still holds


def test_manifest_rehashes_a_file_changed_after_its_early_digest(tmp_path: Path) -> None:
    (tmp_path / "records.jsonl").write_text("a\n")
    (tmp_path / "events.jsonl").write_text("b\n")
    known = manifest.digests(tmp_path, ("events.jsonl",))
    assert set(known) == {"records.jsonl"}
    (tmp_path / "records.jsonl").write_text("changed, longer\n")
    manifest.write(tmp_path, known)
    assert verify(tmp_path) == []


def test_multiplied_run_is_judged_as_by_the_straightforward_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """Four copies in a stretched soak: the cached reuse replay meets salt keys shared by many variants,
    the bootstrap thousands of attempts per family, the percentiles thousands of latencies."""
    big = tmp_path / "x4"
    assert _bench().build_run(_unpack(tmp_path / "run"), big, 4 * 743, 300.0) == 4 * 743
    now, reference = _verdicts(big, monkeypatch)
    assert now == reference


def test_the_bench_allows_only_reuse_intervals_to_move(tmp_path: Path) -> None:
    """The bench's verdict comparison: byte for byte, or the same judgment with only `*_ci95` endpoints
    moved within half a point (the normal intervals of an hour's soak); anything else is a difference."""
    bench = _bench()
    base = {"verdict": "go", "pillars": {"prefix_cache": {"status": "pass", "numbers": {"reuse": {
        "run": {"achieved_share_ci95": [0.9157, 0.9211], "achieved_share": 0.918}}}}}}

    def judged(name: str, change: Any = None) -> Path:
        doc = json.loads(json.dumps(base))
        if change:
            change(doc)
        (tmp_path / name).mkdir()
        (tmp_path / name / "verdict.json").write_text(json.dumps(doc))
        return tmp_path / name

    def move(by: float) -> Any:
        return lambda d: d["pillars"]["prefix_cache"]["numbers"]["reuse"]["run"]["achieved_share_ci95"].__setitem__(
            0, 0.9157 + by)

    reference = judged("reference")
    assert bench._same_verdict(judged("same"), reference) == "identical"
    assert bench._same_verdict(judged("moved", move(0.0001)), reference).startswith("the same judgment (1 ")
    assert bench._same_verdict(judged("far", move(0.01)), reference).startswith("DIFFERENT")
    assert bench._same_verdict(judged("limited", lambda d: d.__setitem__("verdict", "limited")),
                               reference).startswith("DIFFERENT: .verdict")
    assert bench._same_verdict(judged("point", lambda d: d["pillars"]["prefix_cache"]["numbers"]["reuse"]["run"]
                                      .__setitem__("achieved_share", 0.9181)), reference).startswith("DIFFERENT")


def _sorted_percentile(values: list[float], q: float) -> float | None:
    clean = sorted(v for v in values if v is not None)
    return clean[min(round(q * (len(clean) - 1)), len(clean) - 1)] if clean else None


def salt_key(attempt: Any, kind: str) -> tuple[Any, ...]:
    """Requests with equal keys carry the same salt (analysis/pillars/cache/reuse.py's module doc)."""
    if kind == "request":
        return ("request", attempt.stream_pair or attempt.chain_id)
    if kind == "pair":
        return ("pair", attempt.user_id, attempt.control_pair)
    return (kind,)


def _ready_ts(attempt: Any) -> float | None:
    """When the attempt's prompt was in the cache: its first token (or a whole answer's end)."""
    if attempt.first_token_ts is not None:
        return attempt.first_token_ts
    return attempt.end_ts if attempt.status == "ok" else None


def _replay(attempts: list[Attempt], design: dict[str, Any], geometry: Geometry) -> dict[str, int]:
    """designed_tokens as first written: every request compared with every variant seen so far."""
    import heapq

    index = {key: i for i, key in enumerate(design.get("variants") or [])}
    matrix, lengths = design["shared_prefix_tokens"], design["prompt_tokens"]
    kinds = {name: s.get("prefix_salt", "none") for name, s in design["scenarios"].items()}
    other = {i: index.get(key[:-1] + "B", i) for key, i in index.items()}
    seen_same: dict[Any, set[int]] = {}
    seen_keys: dict[int, set[Any]] = {}
    pending: list[Any] = []
    out = {}
    for order, attempt in enumerate(sorted(attempts, key=lambda a: (a.send_ts, a.attempt_id))):
        while pending and pending[0][0] <= attempt.send_ts:
            _, _, variant, key = heapq.heappop(pending)
            seen_same.setdefault(key, set()).add(variant)
            keys = seen_keys.setdefault(variant, set())
            if len(keys) < 2:
                keys.add(key)
        me = index.get(f"{attempt.scenario}/{attempt.turn}/A")
        if me is None or attempt.scenario not in kinds:
            continue
        key = salt_key(attempt, kinds[attempt.scenario])
        best = max((matrix[me][v] for v in seen_same.get(key, ())), default=0)
        best = max([best, *(matrix[me][other[v]] for v, keys in seen_keys.items() if keys - {key})])
        prompt = attempt.prompt_tokens if attempt.prompt_tokens is not None else lengths[me]
        out[attempt.attempt_id] = geometry.floor(min(best, prompt - 1))
        ready = _ready_ts(attempt)
        if ready is not None:
            heapq.heappush(pending, (ready, order, me, key))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_reuse_replay_is_the_straightforward_one(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random designs and traffic: salts per request, per pair, per run and none, chains, retries and
    streaming twins, with few and many variants per salt key (the best prefix kept per variant and key is
    recomputed as groups grow and variants gain keys), requests sent at the same time; the replay's chunks of
    rows (65,536 in a run) cut anywhere."""
    monkeypatch.setattr("k3load.analysis.pillars.cache.reuse_replay.REPLAY_CHUNK", [1, 7, 64, 1000, 65_536, 3][seed])
    rng = random.Random(seed)
    scenarios = {f"s{k}": {"prefix_salt": rng.choice(["request", "pair", "run", "none"]), "turns": 3}
                 for k in range(4)}
    variants = [f"{s}/{t}/{v}" for s in scenarios for t in range(3) for v in "AB"]
    size = len(variants)
    matrix = [[rng.randrange(0, 3000) for _ in range(size)] for _ in range(size)]
    design = {"variants": variants, "shared_prefix_tokens": matrix,
              "prompt_tokens": [rng.randrange(500, 4000) for _ in range(size)], "scenarios": scenarios}
    attempts = []
    for i in range(1500):
        chain = rng.randrange(0, 400)
        send = rng.choice([rng.uniform(0, 300), float(rng.randrange(0, 300))])  # ties: ordered by attempt id
        attempts.append(Attempt(
            run_id="r", attempt_id=rng.choice([f"a{i}"] * 9 + [f"a{rng.randrange(0, i + 1)}"]),  # twice: last wins
            chain_id=f"c{chain}", attempt=rng.randint(1, 2), stage="soak",
            scenario=rng.choice([*scenarios, "unmeasured"]), family="f", turn=rng.randrange(0, 4),
            turn_kind="answer", user_id=f"u{rng.randrange(0, 5)}", request_sha256="h", prefix_sha256="p",
            transport="t", status=rng.choice(["ok", "ok", "ok", "timeout"]), send_ts=send,
            end_ts=send + rng.uniform(0.1, 20), first_token_ts=rng.choice([None, send + rng.uniform(0.05, 5)]),
            prompt_tokens=rng.choice([None, rng.randrange(100, 4000)]), control_pair=rng.choice([None, 1, 2]),
            stream_pair=rng.choice([None, None, f"p{rng.randrange(0, 50)}"])))
    geometry = Geometry(16, rng.choice([None, 64]))
    found = _replay(attempts, design, geometry)
    assert designed_tokens(columns_of(attempts).rows(), design, geometry) == [found.get(a.attempt_id) for a in attempts]


def test_shared_bootstrap_draws_ratio_ci_intervals() -> None:
    rng = random.Random(7)
    for n in (0, 1, 2, 3, 40, 3000):
        num = [rng.randrange(0, 2000) for _ in range(n)]
        dens = [[x + rng.randrange(0, 500) for x in num], [rng.choice([0, 0, rng.randrange(1, 900)]) for _ in num],
                [0] * n, [x * 0.37 for x in num]]
        assert ratio_cis(num, dens) == [ratio_ci(num, d) for d in dens]
    parting = [[0, 0, 5], [1, 1, 1]]  # a resample summing to 0 shortens the first one's chunks
    assert ratio_cis([1, 2, 3], parting) == [ratio_ci([1, 2, 3], d) for d in parting]


def test_from_normal_ratio_from_attempts_the_interval_is_the_normal_one_and_agrees_with_the_bootstrap() -> None:
    """A family of NORMAL_RATIO_FROM attempts takes `ratio_normal_ci`: its endpoints sit within a tenth of
    the bootstrap interval's width of the bootstrap's own (its resampling noise is a few hundredths), on
    skewed token counts where a third of the attempts reuse nothing by design, and on a cold family where
    nine in ten reuse nothing at all. One fewer attempt still takes the bootstrap."""
    rng = np.random.default_rng(11)
    n = NORMAL_RATIO_FROM
    prompt = rng.integers(200, 4000, n)
    designed = (prompt * rng.choice([0.0, 0.5, 0.9], n, p=[0.3, 0.3, 0.4])).astype(int)
    achieved = (designed * rng.uniform(0.7, 1.0, n)).astype(int)
    dens = [list(prompt), list(designed)]
    normal = ratio_cis(list(achieved), dens)
    assert normal == [ratio_normal_ci(achieved, d) for d in dens]
    cold = np.where(rng.random(n) < 0.9, 0, prompt * rng.uniform(0.1, 0.9, n)).astype(int)  # mostly nothing
    for got, num, den in [*zip(normal, [list(achieved)] * 2, dens, strict=True),
                          (ratio_cis(list(cold), [list(prompt)])[0], list(cold), list(prompt))]:
        boot = ratio_ci(num, den)
        assert got is not None and boot is not None
        width = boot[1] - boot[0]
        assert abs(got[0] - boot[0]) < 0.1 * width and abs(got[1] - boot[1]) < 0.1 * width, (got, boot)
    fewer = [list(achieved[:-1]), [d[:-1] for d in dens]]
    assert ratio_cis(*fewer) == [ratio_ci(fewer[0], d) for d in fewer[1]]


def test_the_normal_ratio_interval_stays_where_a_resample_can_be() -> None:
    """Every attempt at the same ratio: a zero-width interval, as every resample gives. Positive
    denominators: never beyond the attempts' own ratios (a wide normal interval would cross 100%);
    with zero denominators no such bound holds, so none is applied."""
    assert ratio_normal_ci([50] * 30, [100] * 30) == (0.5, 0.5)
    assert ratio_normal_ci([100, 0], [100, 100]) == (0.0, 1.0)  # unclipped: 0.5 ± 0.98
    low, high = ratio_normal_ci([100, 100, 0], [100, 100, 100])  # unclipped: 0.67 ± 0.65
    assert 0.0 < low < 0.05 and high == 1.0
    low, high = ratio_normal_ci([5, 90, 100, 0], [0, 100, 100, 1])
    assert high > 1.0 and low < 0.97  # a resample of the first and third attempts gives 105/100
    assert ratio_normal_ci([1], [1]) is None and ratio_normal_ci([1, 2], [0, 0]) is None


def test_percentile_by_selection_is_the_sorted_pick() -> None:
    rng = random.Random(3)
    for n in (1, 10, 5000, 20000):
        values = [rng.choice([rng.uniform(0, 100), float(rng.randrange(0, 4)), None]) for _ in range(n)]
        clean = sorted(v for v in values if v is not None)
        qs = (0.0, 0.5, 0.95, 0.99, 1.0)
        for q in qs:
            assert percentile(values, q) == clean[min(round(q * (len(clean) - 1)), len(clean) - 1)]
        assert percentiles(values, qs) == [percentile(values, q) for q in qs]
        assert percentiles(values, (0.99, 0.5, 0.99)) == [percentile(values, q) for q in (0.99, 0.5, 0.99)]
        known = np.array([v for v in values if v is not None])  # a frame column's values, as the stage table passes
        got = percentiles(known, qs)
        assert got == percentiles(values, qs) and all(type(v) is float for v in got)
    assert str(percentile([0.0, -0.0] * 3000, 0.5)) == str(sorted([0.0, -0.0] * 3000)[3000])
    assert str(percentiles(np.array([0.0, -0.0] * 3000), (0.5,))) == str([sorted([0.0, -0.0] * 3000)[3000]])
    assert percentiles(np.array([], dtype=float), (0.5,)) == [None]


def test_in_send_order_is_the_stable_sort_on_both_keys() -> None:
    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(0, 40)
        frame = pd.DataFrame({"send_ts": [float(rng.randint(0, 6)) for _ in range(n)],
                              "attempt_id": [rng.choice("abcdef") + str(rng.randint(0, 3)) for _ in range(n)],
                              "row": range(n)})
        want = frame.sort_values(["send_ts", "attempt_id"], kind="mergesort").reset_index(drop=True)
        order = in_send_order(RecordColumns.of(frame.to_dict("records")).rows())
        pd.testing.assert_frame_equal(frame.take(order).reset_index(drop=True), want)
    # a send time that is no number (NaN on the columns) sorts after every other
    assert in_send_order(RecordColumns.of([{"send_ts": None, "attempt_id": "a"},
                                           {"send_ts": 1.0, "attempt_id": "b"}]).rows()).tolist() == [1, 0]

