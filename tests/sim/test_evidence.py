"""Compact evidence (k3load.evidence): records and metrics compressed as they are written, read back whole,
from a killed writer up to its last flush, from older runs' plain files, and signed by the manifest
(no sockets; one test kills a writer subprocess)."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Mapping
from pathlib import Path

import pytest

from bench.evidence_size import replay  # the writers on a run's own clock (flushes as it paced them)
from k3load import evidence
from k3load.analysis.outputs import manifest
from k3load.analysis.run.rundata import load_run, read_attempts
from k3load.evidence import METRICS, RECORDS, GzipSink, SeriesTable, lines, metrics_file, records_file
from k3load.records import read_records
from k3load.rundir import JsonlLog
from tests.sim.scale_run import same_columns

ROOT = Path(__file__).resolve().parents[2]


def _as_dicts(line: dict) -> dict:
    """A metrics line as read, its samples (held compactly by the loader) as the dict they stand for."""
    samples = line.get("samples")
    return line | {"samples": dict(samples.items())} if isinstance(samples, Mapping) else line
SCALE_RUN = ROOT / "tests" / "data" / "scale-run"  # a small acceptance run against the sim (743 records)
BYTES_PER_REQUEST = 300  # issue 16: records and metrics together, an hour at 100 requests/s in about 100 MB

ROWS = [{"i": 1, "text": "a\u2028b\u0085c"}, {"i": 2, "text": "é"}, {"i": 3}]  # line breaks only at "\n"


def _plain(rows: list[dict], torn: str = "") -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + torn


def test_a_truncated_gzip_reads_as_the_plain_file_with_the_same_torn_line(tmp_path):
    text = _plain(ROWS, torn='{"i": 4, "te')
    (tmp_path / "records.jsonl").write_text(text, encoding="utf-8")
    z = zlib.compressobj(6, zlib.DEFLATED, 31)
    data = z.compress(text.encode()) + z.flush(zlib.Z_SYNC_FLUSH)  # no end of member: a killed writer
    (tmp_path / RECORDS).write_bytes(data)
    plain, packed = list(lines(tmp_path / "records.jsonl")), list(lines(tmp_path / RECORDS))
    assert packed == plain and len(plain) == 4 and plain[-1] == '{"i": 4, "te'
    for cut in range(len(data)):  # any cut keeps every line wholly before it, in order
        (tmp_path / "cut.jsonl.gz").write_bytes(data[:cut])
        got = list(lines(tmp_path / "cut.jsonl.gz"))
        assert all(line == plain[i] for i, line in enumerate(got) if line.endswith("\n"))


def test_members_written_by_successive_writers_read_in_turn(tmp_path):
    path = tmp_path / "log.jsonl.gz"
    for row in ROWS:
        log = JsonlLog(path)
        log.append(row)
        log.close()
    assert [json.loads(x) for x in lines(path)] == ROWS
    assert gzip.decompress(path.read_bytes()).decode() == _plain(ROWS).replace(": ", ":").replace(", ", ",")


def test_bytes_that_are_not_gzip_are_an_error_not_a_truncation(tmp_path):
    path = tmp_path / RECORDS
    path.write_bytes(gzip.compress(_plain(ROWS).encode()) + _plain(ROWS).encode())  # plain text appended
    with pytest.raises(ValueError, match="not a gzip stream"):
        list(lines(path))


# Run in a fresh interpreter: this test process is gevent-patched (conftest imports locust), where `lines`
# never reads ahead (a thread would be a greenlet). Writes argv[1] in several shapes and prints what it saw.
AHEAD_SCRIPT = r"""
import json, os, sys, threading, zlib
from pathlib import Path
from k3load import evidence
from k3load.evidence import lines

evidence.READ_BYTES = 512  # many blocks, more than the thread may hold ahead
path = Path(sys.argv[1])
ahead_threads = lambda: [t for t in threading.enumerate() if t.name == "k3load-inflate-ahead"]
def plain(rows): return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
rows = [{"i": i, "text": os.urandom(40).hex() + "\u2028\u00e9"} for i in range(400)]
members = [zlib.compress(plain(rows[k:k + 100]).encode(), wbits=31) for k in range(0, 400, 100)]
z = zlib.compressobj(6, zlib.DEFLATED, 31)
path.write_bytes(b"".join(members) + z.compress(b'{"i": 400, "te') + z.flush(zlib.Z_SYNC_FLUSH))
alone, ahead = list(lines(path)), list(lines(path, inflate_ahead=True))
out = {"same": ahead == alone, "count": len(alone), "torn": alone[-1],
       "rows": [json.loads(x) for x in alone[:-1]] == rows}

path.write_bytes(b"".join(members[:2]) + b"not gzip at all" + members[2])
for ahead in (False, True):
    read = []
    try:
        read.extend(lines(path, inflate_ahead=ahead))
    except ValueError as exc:
        out[f"error_{ahead}"] = [str(exc), len(read), read == alone[:len(read)]]

path.write_bytes(b"".join(members))
reader = lines(path, inflate_ahead=True)
out["first_three"] = [next(reader) for _ in range(3)] == alone[:3]
out["threads_while_reading"] = len(ahead_threads())
reader.close()  # a reader that stops early (an error, a break)
out["threads_after_close"] = len(ahead_threads())
out["file_left_open"] = any(os.path.realpath(f"/proc/self/fd/{fd}") == str(path) for fd in os.listdir("/proc/self/fd"))
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_inflating_ahead_reads_the_same_lines_errors_and_torn_end_and_stops_with_its_reader(tmp_path):
    """The analysis inflates records in a second thread (`inflate_ahead`): the same lines in the same order
    across blocks and members, a torn last line, the same error after the same lines where bytes stop being
    gzip, and no thread or open file left by a reader that stopped early."""
    done = subprocess.run([sys.executable, "-c", AHEAD_SCRIPT, str(tmp_path / RECORDS)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert (out["same"], out["count"], out["torn"], out["rows"]) == (True, 401, '{"i": 400, "te', True)
    (message, count, prefix), other = out["error_True"], out["error_False"]
    # every line of the blocks before the one that is not gzip (the first two members', but the last few)
    assert other == out["error_True"] and "not a gzip stream near byte" in message and prefix and 190 < count <= 200
    assert (out["first_three"], out["threads_while_reading"], out["threads_after_close"],
            out["file_left_open"]) == (True, 1, 0, False)
    assert list(lines(tmp_path / RECORDS, inflate_ahead=True)) == list(lines(tmp_path / RECORDS))  # patched: alone


def test_a_gzip_log_is_readable_after_each_flush_and_refuses_writes_once_closed(tmp_path):
    path = tmp_path / RECORDS
    log = JsonlLog(path)
    log.append(ROWS[0])
    log.flush()  # what the flusher, or the next append half a second after the last flush, does
    assert list(lines(path)) == [json.dumps(ROWS[0], ensure_ascii=False, separators=(",", ":")) + "\n"]
    log.close()
    with pytest.raises(ValueError):
        log.append(ROWS[1])


def test_the_sink_flushes_on_an_append_half_a_second_after_its_last_flush(tmp_path):
    clock = [0.0]
    sink = GzipSink(tmp_path / "x.jsonl.gz", every_s=0.5, clock=lambda: clock[0])
    sink.write(b"1\n")
    assert list(lines(tmp_path / "x.jsonl.gz")) == []
    clock[0] = 0.5
    sink.write(b"2\n")
    assert list(lines(tmp_path / "x.jsonl.gz")) == ["1\n", "2\n"]
    sink.close()


def test_metrics_lines_keep_every_sample_and_their_order():
    rows = [{"ts": 1, "source": "a", "ok": True, "samples": {"x{l=\"1\"}": 1.0, "y": 2.0}, "legacy": {}},
            {"ts": 2, "source": "a", "ok": False, "error": "timeout"},
            {"ts": 3, "source": "b", "ok": True, "samples": {"z": None, "y": 3.0, "x{l=\"1\"}": float("nan")}},
            {"ts": 4, "source": "a", "ok": True, "samples": {}, "legacy": {}}]
    writer, reader = SeriesTable(), SeriesTable()
    encoded = [json.loads(json.dumps(writer.encode(r))) for r in rows]
    assert "sample_keys" not in encoded[3] and "samples" not in json.dumps(encoded)
    back = [reader.decode(r) for r in encoded]
    assert json.dumps(back) == json.dumps(rows)  # the same keys in the same order (NaN included)
    assert [list(r) for r in back] == [list(r) for r in rows]
    with pytest.raises(ValueError, match="sample_values"):
        SeriesTable().decode(encoded[2])  # a line whose names were defined earlier, read alone


def test_the_loader_reads_compact_and_plain_run_directories_alike(tmp_path):
    records = gzip.decompress((SCALE_RUN / RECORDS).read_bytes())
    metric_rows = [json.loads(x) for x in gzip.decompress((SCALE_RUN / METRICS).read_bytes()).splitlines()]
    plain, compact = tmp_path / "plain", tmp_path / "compact"
    for run in (plain, compact):
        run.mkdir()
        for name in ("events.jsonl", "run.json", "plan.yaml"):
            (run / name).write_bytes((SCALE_RUN / name).read_bytes())
    (plain / "records.jsonl").write_bytes(records)
    (plain / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metric_rows))
    replay(compact, records.decode().split("\n")[:-1], metric_rows)
    assert records_file(plain).name == "records.jsonl" and records_file(compact).name == RECORDS
    assert metrics_file(plain).name == "metrics.jsonl" and metrics_file(compact).name == METRICS
    a, b = load_run(plain), load_run(compact)
    # repr and json: NaN (a field never measured) is unequal to itself
    assert repr(a.kept) == repr(b.kept) and same_columns(a.columns, b.columns)
    assert repr(read_attempts(records_file(plain))) == repr(read_attempts(records_file(compact)))
    assert json.dumps([_as_dicts(m) for m in a.metrics]) == json.dumps([_as_dicts(m) for m in b.metrics])
    assert repr(read_records(records_file(plain))) == repr(read_records(records_file(compact)))
    assert not a.problems and not b.problems


def test_a_sim_runs_records_and_metrics_take_at_most_300_bytes_per_request(tmp_path):
    """tests/data/scale-run: 743 attempts in 21 s against the sim (35 requests/s, the demo's pacing), 24 scrapes
    of 350 series; its raw lines took 1,970 B per record and 32,900 B per scrape."""
    record_lines = gzip.decompress((SCALE_RUN / RECORDS).read_bytes()).decode().split("\n")[:-1]
    metric_rows = [json.loads(x) for x in gzip.decompress((SCALE_RUN / METRICS).read_bytes()).splitlines()]
    replay(tmp_path, record_lines, metric_rows)
    size = (tmp_path / RECORDS).stat().st_size + (tmp_path / METRICS).stat().st_size
    attempts = read_records(tmp_path / RECORDS)
    assert len(attempts) == len(record_lines) == 743
    assert size / len(attempts) <= BYTES_PER_REQUEST, f"{size / len(attempts):.0f} B per request"


KILLED = """
import sys, time, json
if sys.argv[2] == "gevent":
    from gevent import monkey; monkey.patch_all()
from pathlib import Path
from k3load.rundir import JsonlLog
from tests.sim.scale_run import same_columns
log, i = JsonlLog(Path(sys.argv[1])), 0
print("ready", flush=True)
end = time.monotonic() + 1.5
while time.monotonic() < end:  # busy: a line every 5 ms, as records come
    i += 1
    log.append({"i": i, "ts": time.time()})
    time.sleep(0.005)
print(i, flush=True)  # then idle: only the flusher can write what is left
time.sleep(60)
"""


@pytest.mark.parametrize("threads", ["threads", "gevent"])
def test_a_writer_killed_with_sigkill_loses_at_most_the_last_second(tmp_path, threads):
    path = tmp_path / RECORDS
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(path), threads], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.8)
        busy_kill = time.time()  # a copy of the file now, taken as a kill would leave it
        snapshot = path.read_bytes()
        written = int(proc.stdout.readline())
        time.sleep(1.0)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    (tmp_path / "busy.jsonl.gz").write_bytes(snapshot)
    busy = [json.loads(x) for x in lines(tmp_path / "busy.jsonl.gz") if x.endswith("\n")]
    assert busy and busy[-1]["ts"] >= busy_kill - 1.0, "more than the last second lost while busy"
    assert [r["i"] for r in busy] == list(range(1, len(busy) + 1))
    idle = [json.loads(x) for x in lines(path)]
    assert [r["i"] for r in idle] == list(range(1, written + 1)), "the idle writer's last lines were not flushed"


def test_verify_catches_a_changed_compressed_file_and_analysis_reads_a_killed_one(tmp_path):
    log = JsonlLog(tmp_path / RECORDS)
    for line in gzip.decompress((SCALE_RUN / RECORDS).read_bytes()).decode().split("\n")[:20]:
        log.append_line(line)
    log.flush()  # a killed run's file: flushed, never closed
    assert len(load_run(tmp_path).columns) == 20
    (tmp_path / "run.json").write_text("{}")
    assert manifest.write(tmp_path) == 2 and manifest.verify(tmp_path) == []
    data = bytearray((tmp_path / RECORDS).read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / RECORDS).write_bytes(bytes(data))
    assert manifest.verify(tmp_path) == [f"changed: {RECORDS}"]


def test_the_reader_prefers_the_compressed_file(tmp_path):
    assert evidence.evidence_file(tmp_path, RECORDS) == tmp_path / RECORDS  # neither: where it will be
    (tmp_path / "records.jsonl").write_text("")
    assert records_file(tmp_path) == tmp_path / "records.jsonl"
    (tmp_path / RECORDS).write_bytes(b"")
    assert records_file(tmp_path) == tmp_path / RECORDS


def test_a_compressed_spool_is_final_once_sealed_and_a_new_one_at_its_path_is_read_afresh(tmp_path):
    from k3load.loadgen.spools import SpoolTails, attempt_lines, final_line, is_final

    path, tails = tmp_path / "worker-1.jsonl.gz", SpoolTails()
    spool = JsonlLog(path)
    spool.append_line('{"attempt_id": "a"}')
    spool.flush()
    assert not is_final(path, tails)
    spool.append(final_line())
    spool.flush()
    assert is_final(path, tails) and [a for a, _ in attempt_lines(path)] == ["a"]
    spool.append_line('{"attempt_id": "b"}')  # users started again: not final until sealed again
    spool.flush()
    assert not is_final(path, tails)
    spool.close()
    path.rename(tmp_path / "moved.jsonl.gz")  # the run set aside; the same worker's next spool
    again = JsonlLog(path)
    again.append(final_line())
    again.flush()
    assert is_final(path, tails) and list(attempt_lines(path)) == []
    again.close()
    assert list(attempt_lines(tmp_path / "moved.jsonl.gz")) == [("a", '{"attempt_id": "a"}'),
                                                                 ("b", '{"attempt_id": "b"}')]
    other = tmp_path / "next-run" / "worker-1.jsonl.gz"  # a later run's spool: kept when the first run's go
    other.parent.mkdir()
    JsonlLog(other).close()
    assert not is_final(other, tails) and len(tails) == 2
    tails.forget(tmp_path)  # the first run ended: only the later run's follower is kept
    assert len(tails) == 1 and not is_final(other, tails)


def test_the_web_uis_tail_follows_a_compressed_metrics_log_as_it_is_written(tmp_path):
    from k3load.loadgen.tail import Tail

    rows = [{"ts": t, "source": "a", "ok": True, "samples": {"x": float(t), f"new{t}": 1.0}} for t in range(4)]
    tail = Tail(tmp_path, METRICS, SeriesTable())
    assert list(tail.lines()) == []  # not written yet
    log = JsonlLog(tmp_path / METRICS, encode=SeriesTable().encode, clock=lambda: 0.0)  # no flush on append
    log.append(rows[0])
    log.append(rows[1])
    assert list(tail.lines()) == []  # not flushed yet: nothing half-read
    log.flush()
    assert list(tail.lines()) == rows[:2]
    log.append(rows[2])
    log.close()
    assert list(tail.lines()) == rows[2:3] and list(tail.lines()) == []


def test_a_tail_read_hours_late_skips_the_rows_before_since_and_reads_a_chunk_at_a_time(tmp_path):
    """A capacity search begun late in a day reads the scrapes of its step only: the rows before `since` teach
    the series table their names (a later row may use them) and are never decoded; the file is read a chunk
    at a time, compressed or plain, a line longer than a chunk included."""
    from k3load.evidence import Follow
    from k3load.loadgen.tail import Tail

    rows = [{"ts": float(t), "source": "a", "ok": True, "samples": {f"s{t % 7}": float(t), "x": 1.0}}
            for t in range(3000)]
    log = JsonlLog(tmp_path / METRICS, encode=SeriesTable().encode)
    for row in rows:
        log.append(row)
    log.close()
    tail = Tail(tmp_path, METRICS, SeriesTable())
    tail.follow = Follow(tmp_path / METRICS)
    chunks = iter(tail.follow.iter_new_lines(chunk_bytes=4096))
    first = next(chunks)
    assert tail.follow.offset == 4096 and json.loads(first)["ts"] == 0.0  # one chunk read, not the file
    tail.follow = None
    assert list(tail.lines(since=2990.0)) == rows[2990:]
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"a": "' + "x" * 10_000 + '"}\n{"b": 1}\n{"torn')
    follow = Follow(plain)
    assert [len(x) for x in follow.iter_new_lines(chunk_bytes=1024)] == [10_010, 9]
    assert follow.new_lines() == []  # the torn line waits for its end
    with plain.open("a") as handle:
        handle.write('": 2}\n')
    assert follow.new_lines() == ['{"torn": 2}\n']
