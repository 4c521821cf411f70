"""Bytes per request of a run's evidence: records and metrics as JSON lines against compact evidence.

Reference: "raw", the plain records.jsonl and metrics.jsonl the harness wrote before compact evidence
(k3load.evidence), written from the same run's lines in the same run of this script. Measured against it:
"compact", the same lines written again by the harness's own writers (`JsonlLog` on records.jsonl.gz,
and on metrics.jsonl.gz with `SeriesTable.encode`), each flushed as the run's own clock says (records by
their end time, scrapes by theirs: at most every half second, as a live run flushes), and "gzip -9", the
raw files compressed whole (what compression alone gives, no flushes). Printed per record, per scrape,
per request (records and metrics together over the attempts), the hour at 100 requests/s that makes, the
ratios raw / compact, the writers' CPU per record, and `load_run` wall time on each (the analysis reads
the compressed files back: its share of the cost).

    .venv/bin/python bench/evidence_size.py [--source tests/data/scale-run | runs/demo]
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3load.analysis.run.rundata import load_run  # noqa: E402
from k3load.evidence import METRICS, RECORDS, SeriesTable, lines, metrics_file, records_file  # noqa: E402
from k3load.rundir import JsonlLog  # noqa: E402

HOUR_AT_100 = 360_000  # requests in an hour at 100 requests/s (issue 16's yardstick)
COPIED = ("run.json", "plan.yaml", "events.jsonl", "gpu.jsonl", "compat.json", "reuse_design.json")


def replay(run: Path, record_lines: list[str], metric_rows: list[dict[str, Any]]) -> tuple[float, float]:
    """The lines written again into `run` by the harness's writers on the run's own clock (records flushed
    by their end times, every scrape flushed, as at 1 Hz); the CPU seconds of the records' and the metrics'."""
    ends = [json.loads(line)["end_ts"] for line in record_lines]
    clock = [0.0]
    started = time.process_time()
    records = JsonlLog(run / RECORDS, clock=lambda: clock[0])
    for line, end in zip(record_lines, ends, strict=True):
        clock[0] = end
        records.append_line(line)
    records.close()
    middle = time.process_time()
    metrics = JsonlLog(run / METRICS, encode=SeriesTable().encode, clock=lambda: clock[0])
    for row in metric_rows:
        clock[0] += 1.0
        metrics.append(row)
    metrics.close()
    return middle - started, time.process_time() - middle


def read_source(source: Path) -> tuple[list[str], list[dict[str, Any]]]:
    records = [line.removesuffix("\n") for line in lines(records_file(source)) if line.endswith("\n")]
    table = SeriesTable()
    metrics = [table.decode(json.loads(line)) for line in lines(metrics_file(source)) if line.endswith("\n")]
    return records, metrics


def _dir(base: Path, name: str, source: Path) -> Path:
    run = base / name
    run.mkdir()
    for copied in COPIED:
        if (source / copied).exists():
            shutil.copy2(source / copied, run / copied)
    return run


def _load_s(run: Path) -> float:
    started = time.perf_counter()
    load_run(run)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=ROOT / "tests" / "data" / "scale-run")
    args = parser.parse_args()
    record_lines, metric_rows = read_source(args.source)
    if not record_lines:
        raise SystemExit(f"{args.source}: no records")
    with tempfile.TemporaryDirectory() as tmp:
        raw, compact, whole = (_dir(Path(tmp), name, args.source) for name in ("raw", "compact", "gzip9"))
        raw_records = "".join(line + "\n" for line in record_lines).encode()
        raw_metrics = "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n"
                              for r in metric_rows).encode()
        (raw / "records.jsonl").write_bytes(raw_records)
        (raw / "metrics.jsonl").write_bytes(raw_metrics)
        (whole / RECORDS).write_bytes(gzip.compress(raw_records, 9))
        (whole / METRICS).write_bytes(gzip.compress(raw_metrics, 9))
        cpu_s = replay(compact, record_lines, metric_rows)
        table = {name: ((run / files[0]).stat().st_size, (run / files[1]).stat().st_size) for name, run, files in (
            ("raw", raw, ("records.jsonl", "metrics.jsonl")), ("compact", compact, (RECORDS, METRICS)),
            ("gzip -9", whole, (RECORDS, METRICS)))}
        loads = {"raw": _load_s(raw), "compact": _load_s(compact)}
    n, scrapes = len(record_lines), max(len(metric_rows), 1)
    print(f"{args.source}: {n} attempts, {len(metric_rows)} scrapes")
    print(f"{'':<10} {'B/record':>10} {'B/scrape':>10} {'B/request':>10} {'raw/this':>9} {'hour at 100/s MB':>17}")
    raw_per = sum(table["raw"]) / n
    for name, (rec, met) in table.items():
        per, hour = (rec + met) / n, (rec / n * HOUR_AT_100 + met / scrapes * 3600) / 1e6  # 1 Hz scrapes
        print(f"{name:<10} {rec / n:>10.0f} {met / scrapes:>10.0f} {per:>10.0f} {raw_per / per:>9.2f} {hour:>17.0f}")
    print(f"B/request: both files over this run's attempts ({n / _span_s(record_lines):.0f}/s); the hour: records "
          f"x {HOUR_AT_100}, scrapes x 3600")
    print(f"writers' CPU (compact): {cpu_s[0] / n * 1e6:.0f} µs per record, {cpu_s[1] / scrapes * 1e3:.1f} ms per "
          f"scrape; load_run: raw {loads['raw']:.2f} s, compact {loads['compact']:.2f} s "
          f"(x{loads['compact'] / loads['raw']:.2f})")


def _span_s(record_lines: list[str]) -> float:
    records = [json.loads(line) for line in record_lines]
    return max(max(r["end_ts"] for r in records) - min(r["send_ts"] for r in records), 1e-9)


if __name__ == "__main__":
    main()
