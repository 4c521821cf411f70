"""The run directory: an earlier run found where a new one starts is moved whole to a sibling, never
mixed with the new run nor lost; every file in it is its owner's only (0600, folders 0700), and a file
copied in is redacted on the way, also when the copy is interrupted (no sockets, tmp dirs only; one test
kills a copying subprocess)."""

from __future__ import annotations

import argparse
import io
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from k3load.analysis.outputs import manifest
from k3load.client.access import Secrets
from k3load.loadgen.inputs import load_inputs
from k3load.loadgen.redact_lines import VALUES_ENV
from k3load.precheck.evidence import Gatherer, evidence_hashes
from k3load.private_files import exposed, is_temp, make_run_dir, narrow_existing, restrict_umask
from k3load.rundir import (
    JsonlLog,
    copy_file_redacted,
    previous_run_id,
    set_aside_previous_run,
    write_atomic,
    write_json_atomic,
)
from k3load.workload.stored_requests import write_stored_requests
from tests.secret_scan import leaks

ROOT = Path(__file__).resolve().parents[2]


def _previous_run(run: Path, run_id: str = "r1") -> None:
    """A finished run as a Locust run leaves it: logs, documents, evidence, a subfolder, Locust's CSV."""
    (run / "samples").mkdir(parents=True)
    (run / "evidence").mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": run_id, "unsigned_files": ["locust_stats.csv"]}))
    (run / "records.jsonl").write_text(json.dumps({"run_id": run_id, "attempt_id": "a1"}) + "\n")
    (run / "events.jsonl").write_text(json.dumps({"ts": 1, "event": "run_start", "run_id": run_id}) + "\n")
    (run / "verdict.json").write_text("{}\n")
    (run / "samples" / "agent.json").write_text("{}\n")
    (run / "evidence" / "startup.log").write_text("started\n")
    (run / "locust_stats.csv").write_text("old stats\n")
    manifest.write(run)


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_previous_run_moves_whole_to_a_sibling_named_after_its_run_id(tmp_path):
    run = tmp_path / "latest"
    _previous_run(run)
    before = _tree(run)
    moved = set_aside_previous_run(run)
    assert moved == tmp_path / "latest.previous-r1"
    assert _tree(moved) == before and manifest.verify(moved) == []
    assert run.is_dir() and list(run.iterdir()) == []


def test_files_in_use_stay_and_a_signed_one_is_copied_along(tmp_path):
    """Locust's --csv / --logfile outputs (open before the run starts) and this run's inputs stay put,
    also inside a subfolder; an input the previous manifest signed goes along as a copy too."""
    run = tmp_path / "latest"
    _previous_run(run)
    (run / "logs").mkdir()
    (run / "logs" / "locust.log").write_text("log line\n")
    (run / "logs" / "old.txt").write_text("old\n")
    manifest.write(run)
    keep = {run / "locust_stats.csv", run / "logs" / "locust.log", run / "evidence" / "startup.log"}
    moved = set_aside_previous_run(run, keep)
    assert moved is not None
    assert _tree(run) == {"locust_stats.csv": "old stats\n", "logs/locust.log": "log line\n",
                          "evidence/startup.log": "started\n"}
    assert {"records.jsonl", "run.json", "logs/old.txt", "evidence/startup.log"} <= set(_tree(moved))
    assert "locust_stats.csv" not in _tree(moved)  # unsigned: its run never vouched for it
    assert manifest.verify(moved) == []


def test_an_existing_sibling_is_never_overwritten(tmp_path):
    run = tmp_path / "latest"
    taken = tmp_path / "latest.previous-r1"
    taken.mkdir()
    (taken / "records.jsonl").write_text("older\n")
    _previous_run(run)
    moved = set_aside_previous_run(run)
    assert moved == tmp_path / "latest.previous-r1-2"
    assert (taken / "records.jsonl").read_text() == "older\n"
    _previous_run(run, "r1")
    assert set_aside_previous_run(run) == tmp_path / "latest.previous-r1-3"


def test_no_run_here_touches_nothing(tmp_path):
    assert set_aside_previous_run(tmp_path / "missing") is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert set_aside_previous_run(empty) is None
    assert list(tmp_path.iterdir()) == [empty] and list(empty.iterdir()) == []
    baseline = tmp_path / "baseline"  # a side sampler's idle baseline, recorded for the run about to start
    baseline.mkdir()
    (baseline / "metrics.jsonl").write_text("{}\n")
    (baseline / "events.jsonl").write_text(json.dumps({"ts": 1, "event": "server_up"}) + "\n")
    assert set_aside_previous_run(baseline) is None
    assert sorted(p.name for p in baseline.iterdir()) == ["events.jsonl", "metrics.jsonl"]


def test_the_run_id_comes_from_run_json_then_run_start_then_the_mtime(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text('{"ts": 1, "event": "server_up"}\nnot json "run_start"\n'
                                      + json.dumps({"ts": 2, "event": "run_start", "run_id": "from-events"}) + "\n")
    assert previous_run_id(run) == "from-events"
    (run / "run.json").write_text(json.dumps({"run_id": "from-run-json"}))
    assert previous_run_id(run) == "from-run-json"
    (run / "run.json").write_text("{half")
    (run / "events.jsonl").unlink()
    os.utime(run, (0, 0))
    assert previous_run_id(run) == "19700101T000000Z"
    (run / "run.json").write_text(json.dumps({"run_id": "../../etc x"}))
    assert set_aside_previous_run(run) == tmp_path / "run.previous-etc_x"


# -- secrets at rest (issue 36, item 5) -------------------------------------------------------------------
KEY = "sk-k3-SECRET-4f9a2c"


def _modes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix() or ".": oct(stat.S_IMODE(p.stat().st_mode))
            for p in [root, *sorted(root.rglob("*"))]}


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, under which a file made without a mode of its own is 0644 and a folder 0755."""
    before = os.umask(0o022)
    yield
    os.umask(before)


def test_every_file_of_a_run_directory_is_0600_and_every_folder_0700(tmp_path: Path, umask_022: None) -> None:
    """Through each writer a run directory gets its files from: the logs (plain and compressed, the spool's
    folder), whole documents, the evidence copies and bodies, the stored requests, a restart command's log,
    the manifest, a previous run set aside; and a run directory that existed 0755 is narrowed."""
    run = tmp_path / "runs" / "latest"
    run.mkdir(parents=True)
    make_run_dir(run)
    for name in ("events.jsonl", "gpu.jsonl", "records.jsonl.gz", "metrics.jsonl.gz", "spool/worker-1.jsonl.gz"):
        log = JsonlLog(run / name)
        log.append({"ts": 1, "event": "run_start", "run_id": "r1"})
        log.close()
    write_atomic(run / "plan.yaml", "stages: []\n")
    write_json_atomic(run / "run.json", {"run_id": "r1"})
    source = tmp_path / "startup.log"
    source.write_text(f"vllm serve --api-key {KEY}\n")
    gatherer = Gatherer(run, Secrets(KEY))
    gatherer.copy(source, "startup.log")
    gatherer.write("server/version.json", b'{"version": "0.32.0"}', "http://127.0.0.1:1/version")
    gatherer.write("container/image.json", {"image": "vllm/vllm-openai:x"}, "--image")
    gatherer.finish()
    scenarios, _ = load_inputs(argparse.Namespace(k3_scenarios=str(ROOT / "scenarios" / "*.yaml"), k3_plan="smoke"),
                               ROOT / "plans")
    write_stored_requests([next(iter(scenarios.values()))[0]], run / "samples", "m", lambda s: None)
    env = {**os.environ, VALUES_ENV: json.dumps([KEY])}
    subprocess.run([sys.executable, "-m", "k3load.loadgen.redact_lines", str(run / "restart-1.log")],
                   input=f"serving with {KEY}\n".encode(), env=env, check=True, cwd=ROOT)
    manifest.write(run)
    modes = _modes(run)
    assert {"restart-1.log", "evidence/startup.log", "samples/SHA256SUMS", "manifest.sha256",
            "spool/worker-1.jsonl.gz"} <= set(modes)
    assert {p: m for p, m in modes.items() if m != ("0o700" if (run / p).is_dir() else "0o600")} == {}
    assert exposed(run) == [] and KEY not in (run / "restart-1.log").read_text()
    (run / "late.txt").write_text("Locust's own output, made with the umask\n")
    assert exposed(run) == ["late.txt"]
    moved = set_aside_previous_run(run, keep={run / "late.txt"})
    assert moved is not None and exposed(moved) == [] and oct(stat.S_IMODE(moved.stat().st_mode)) == "0o700"


def test_others_outputs_are_narrowed_and_the_umask_only_ever_restricted(tmp_path: Path, umask_022: None) -> None:
    """Locust's own outputs (opened before the run starts) narrowed at start; the umask that covers what
    Locust opens later keeps every bit it had and adds group and other."""
    late = [tmp_path / "locust_stats.csv", tmp_path / "locust.log"]
    for path in late:
        path.write_text("x\n")
    narrow_existing([*late, tmp_path / "absent.csv"])
    assert exposed(tmp_path) == []
    before = restrict_umask()
    try:
        (tmp_path / "later.csv").write_text("y\n")
        assert before == 0o022 and oct(stat.S_IMODE((tmp_path / "later.csv").stat().st_mode)) == "0o600"
    finally:
        os.umask(before)


class _Interrupted(Exception):
    pass


class _DiesMidway(io.BytesIO):
    """A source that fails after `reads` reads (a disk error, a Ctrl-C mid-copy)."""

    def __init__(self, data: bytes, reads: int) -> None:
        super().__init__(data)
        self.reads = reads

    def read(self, size: int | None = -1) -> bytes:
        self.reads -= 1
        if self.reads < 0:
            raise _Interrupted
        return super().read(size)


def test_an_interrupted_evidence_copy_leaves_nothing_and_never_a_secret(tmp_path: Path) -> None:
    data = b"".join(f"line {i} --api-key {KEY} {quote(KEY)}\n".encode() for i in range(2000))
    for reads in (0, 1, 3):
        with pytest.raises(_Interrupted):
            copy_file_redacted(_DiesMidway(data, reads), tmp_path / "evidence" / "startup.log", Secrets(KEY),
                               chunk_bytes=4096)
        assert [p.name for p in (tmp_path / "evidence").iterdir()] == []  # no copy, no temporary file


def test_a_copy_killed_mid_way_leaves_only_redacted_bytes(tmp_path: Path) -> None:
    """The precheck's copy of a startup log in a process killed with SIGKILL half way: what it leaves (its
    temporary file) holds the part copied so far, redacted; the next precheck starts from a clean folder."""
    fifo = tmp_path / "startup.fifo"
    os.mkfifo(fifo)
    out = tmp_path / "run"
    code = ("import sys; from pathlib import Path; from k3load.client.access import Secrets\n"
            "from k3load.precheck.evidence import Gatherer\n"
            f"Gatherer(Path({str(out)!r}), Secrets({KEY!r})).copy(Path({str(fifo)!r}), 'startup.log')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        with fifo.open("wb") as writer:
            for i in range(400):  # about 3 MiB: more than one chunk reaches the temporary file
                writer.write(b"".join(f"{i}.{j} serving --api-key {KEY} %73k-k3\\u002dSECRET-4f9a2c\n".encode()
                                      for j in range(200)))
            deadline = time.monotonic() + 30
            while not any((out / "evidence").glob(".startup.log.*")) and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.kill()
    except BrokenPipeError:
        pass
    proc.wait(30)
    left = [p for p in (out / "evidence").rglob("*") if p.is_file()]
    assert left and all(is_temp(p) for p in left), left  # no startup.log: the copy never finished
    for path in left:
        text = path.read_text()
        assert "[redacted]" in text and not leaks(text, KEY) and oct(stat.S_IMODE(path.stat().st_mode)) == "0o600"
    assert evidence_hashes(out) == []  # a leftover is never evidence
    Gatherer(out, Secrets(KEY))  # the next precheck: a clean folder
    assert list((out / "evidence").iterdir()) == []
