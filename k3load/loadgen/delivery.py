"""Every worker's records reach the master by Locust messages; the master counts what arrived per worker.

    worker  join_run     -> `k3_join` {run_id, spool (name or None), host, pid}   master: the worker is in the ledger
    worker  each attempt -> `k3_record` (the record's JSON line)                  master: written once per attempt id
    worker  test_stop    -> `k3_done` {run_id, sent, unsent, spool}               master: the worker's own count
    master  finish_run   -> `collect`: waits (bounded) until each worker said done and as many of its records
                            arrived as it says it sent; what is still missing is read from the worker's spool
                            where the run directory is shared; each worker still short is named (an error log
                            line, the `worker_spools` event, the validation summary's problems)

Why no set of every attempt id written: over a day at 100 requests/s that set alone held about 1 GB of the
master. A worker sends each record once, so a duplicate can only come from its spool: the spool's attempts
are checked against the records file itself when one is read (`written_ids`), and the few it adds are kept
(`Workers.recovered`) so that a message arriving late for one of them is not written twice.

Why counts: a worker on another machine shares no disk with the master, so the messages are the only path,
and a count per worker turns "nothing lost" into a check the master makes before it judges.

Why `pump`: in a headless run Locust's master quits before `quitting` fires (it tells its workers to quit,
waits half a second and kills its message listener: locust/runners.py MasterRunner.quit), while the
workers' users still finish their turns for up to --stop-timeout. Once Locust's listener is gone, the wait
reads the master's socket itself and hands each of our messages (k3load.events.Message) to the handler
registered for it (Locust's own messages are dropped then: its runner has quit).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import gevent
import msgspec
from locust.exception import RPCError, RPCReceiveError, RPCSendError
from locust.rpc.protocol import Message as LocustMessage
from locust.runners import MasterRunner

from k3load.events import Event, Message
from k3load.evidence import lines, records_file
from k3load.loadgen import cpu, replay, spools
from k3load.loadgen.open_run import OpenRun
from k3load.rundir import JsonlLog

log = logging.getLogger("k3load")
WAIT_MARGIN_S = 10.0  # on top of --stop-timeout: a worker's stop, its last sends and its spool's seal
PUMP_STEP_S = 0.1
SPOOL_NAME = re.compile(r"worker-[0-9]{1,10}\.jsonl(?:\.gz)?")  # k3load.loadgen.worker.WorkerLink.join
SPOOL_GRACE_S = 2.0  # a sealed spool ends the wait for its worker only after this: its messages come first
OURS = frozenset(Message)  # the messages `pump` hands on after Locust's master quit (k3load.events)


@dataclass
class Tally:
    """One worker's account in the current run."""

    host: str = ""
    pid: int | None = None
    spool: str | None = None  # its spool file's name under DIR/spool/, None where the run directory is not shared
    received: int = 0  # k3_record messages that reached the master
    sent: int | None = None  # the worker's own count at its last k3_done; None while its users run
    unsent: int = 0  # records the worker could not send (its send_message failed)
    recovered: int = 0  # attempts read from its spool at the end that no message brought

    @property
    def complete(self) -> bool:
        return self.sent is not None and self.received >= self.sent


@dataclass
class Workers:
    """The master's ledger: every worker that joined this run, what it sent and what arrived."""

    tallies: dict[str, Tally] = field(default_factory=dict)
    recovered: set[str] = field(default_factory=set)  # attempt ids added from spools: a late message for one is dropped
    # while the spools are read: the ids messages brought meanwhile (the records file is read once, then written)
    during_reconcile: set[str] | None = None

    def clear(self) -> None:
        self.tallies.clear()
        self.recovered.clear()
        self.during_reconcile = None

    def tally(self, worker: str) -> Tally:
        return self.tallies.setdefault(worker, Tally())

    def joined(self, worker: str, data: dict[str, Any]) -> None:
        tally = self.tally(worker)
        tally.host, tally.pid = str(data.get("host") or ""), data.get("pid")
        tally.spool = _spool_name(data.get("spool"))

    def received(self, worker: str) -> None:
        """A record arrived: a worker that sends records is not done (its users run again)."""
        tally = self.tally(worker)
        tally.received += 1
        tally.sent = None

    def done(self, worker: str, data: dict[str, Any]) -> None:
        tally = self.tally(worker)
        tally.sent, tally.unsent = int(data.get("sent") or 0), int(data.get("unsent") or 0)
        tally.spool = _spool_name(data["spool"]) if "spool" in data else tally.spool

    def pending(self, spool_dir: Path, sealed_at: dict[str, float] | None = None, now: float = 0.0) -> list[str]:
        """Workers not complete by message, but for one whose spool is sealed (FINAL) since SPOOL_GRACE_S: its
        spool holds every record (read at the end), its last messages may never come. `sealed_at` (worker ->
        when its seal was first seen) is kept by the caller; without it a sealed spool counts at once."""
        out = []
        for worker, tally in sorted(self.tallies.items()):
            if tally.complete:
                continue
            if tally.spool and spools.is_final(spool_dir / tally.spool):
                first = (sealed_at if sealed_at is not None else {}).setdefault(worker, now)
                if sealed_at is None or now - first >= SPOOL_GRACE_S:
                    continue
            out.append(worker)
        return out

    def wait(self, spool_dir: Path, timeout_s: float, sleep: Callable[[float], object],
             clock: Callable[[], float] = time.monotonic) -> list[str]:
        """Waits until no worker is pending or `timeout_s` passed; returns the workers still pending."""
        deadline, sealed_at = clock() + timeout_s, dict[str, float]()
        pending = self.pending(spool_dir, sealed_at, clock())
        while pending and clock() < deadline:
            sleep(PUMP_STEP_S)
            pending = self.pending(spool_dir, sealed_at, clock())
        return pending

    def describe(self, worker: str) -> str:
        """A noun phrase naming the worker and what is known of its records (the run's problems quote it)."""
        t = self.tallies.get(worker, Tally())
        where = f"{t.host}:{t.pid}" if t.host else f"pid {t.pid}"
        if t.sent is None:
            count = f"{t.received} records arrived, no final count"
        elif t.complete:
            count = f"all {t.sent} records it sent arrived"
        else:
            count = f"sent {t.sent} records, {t.received} arrived, {t.sent - t.received} missing"
        unsent = f", {t.unsent} could not be sent" if t.unsent else ""
        spool = f"spool {t.spool}" if t.spool else "no spool: run directory not shared"
        return f"worker {worker} ({where}; {count}{unsent}; {spool})"


class MasterSide(Protocol):
    """What the master's message handlers read of its session (k3load.loadgen.session.HarnessSession): the run
    now (a web UI's next test is a new one), its events, the ledger, and where a record is written."""

    @property
    def run_id(self) -> str: ...

    @property
    def events(self) -> JsonlLog | None: ...

    @property
    def workers(self) -> Workers: ...

    def write_record_line(self, attempt_id: str, line: str) -> bool: ...


def register(runner: MasterRunner, session: MasterSide) -> None:
    """Master: the workers' messages (k3load.events.Message)."""
    runner.register_message(Message.JOIN, _of_this_run(session, session.workers.joined))
    runner.register_message(Message.RECORD, lambda msg, **_kw: on_record(session, msg.node_id, msg.data))
    runner.register_message(Message.DONE, _of_this_run(session, session.workers.done))
    runner.register_message(Message.CPU, _of_this_run(session, lambda w, d: cpu.write_reading(session.events, w, d)))
    runner.register_message(Message.REPLAY, _of_this_run(session, lambda w, d: replay.write_from_worker(
        session.events, w, d)))


def _of_this_run(session: MasterSide, handle: Callable[[str, Any], None]) -> Callable[..., None]:
    """A message handler: `handle(worker, data)` for a message of this run, nothing for an earlier run's."""

    def handler(msg: LocustMessage, **_kw: Any) -> None:
        if _this_run(session, msg):
            handle(msg.node_id, msg.data)

    return handler


def _this_run(session: MasterSide, msg: LocustMessage) -> bool:
    """A message of an earlier run (a web UI test before this one) is not this run's to count."""
    run_id = (msg.data or {}).get("run_id") if isinstance(msg.data, dict) else None
    return run_id is None or run_id == session.run_id


def on_record(session: MasterSide, worker: str, line: str) -> None:
    """Master: a worker's record, counted for that worker and written once per attempt id."""
    record = json.loads(line)
    if record.get("run_id") not in (None, session.run_id):
        log.warning("k3load: a record of run %s arrived during run %s from worker %s: not written",
                    record.get("run_id"), session.run_id, worker)
        return
    session.workers.received(worker)
    attempt_id = record["attempt_id"]
    if attempt_id in session.workers.recovered:
        return  # its spool brought it already (the message came after the wait)
    if session.workers.during_reconcile is not None:
        session.workers.during_reconcile.add(attempt_id)
    session.write_record_line(attempt_id, line)


def pump(runner: MasterRunner, step_s: float = PUMP_STEP_S) -> bool:
    """One step of the wait: a sleep while Locust's master listens to its workers; once it has quit (its
    greenlets killed), one message read from its socket and, if it is one of ours, handled (True then)."""
    if len(runner.greenlet):
        gevent.sleep(step_s)
        return False
    received = None
    try:
        with gevent.Timeout(step_s, False):
            received = runner.server.recv_from_client()
    except (RPCError, RPCReceiveError, RPCSendError) as exc:
        log.debug("k3load: reading the workers after Locust quit: %s", exc)
        gevent.sleep(step_s)
        return False
    if received is None:
        return False
    _worker, msg = received
    handler = runner.custom_messages.get(msg.type) if msg.type in OURS else None
    if handler is None:
        return False
    try:
        handler[0](environment=runner.environment, msg=msg)
    except Exception:  # as Locust's own listener does: one bad message must not end the wait
        log.exception("k3load: handling %s from worker %s", msg.type, _worker)
    return True


def collect(run: OpenRun, workers: Workers, write: Callable[[str, str], bool], runner: MasterRunner,
            timeout_s: float) -> list[str]:
    """Master at the end of `run`: every worker's records in (bounded), spools read where a worker is short (each
    attempt through `write`, once), and the workers still short returned as the run's problems (each also logged
    as an error, never dropped)."""
    spool_dir = run.run_dir / "spool"
    pumped = [0]  # k3_* messages read by `pump` after Locust's master quit

    def step(seconds: float) -> None:
        pumped[0] += pump(runner, seconds)

    short = workers.wait(spool_dir, timeout_s, sleep=step if hasattr(runner, "server") else gevent.sleep)
    recovered = _reconcile(workers, write, spool_dir, lambda among: written_ids(run, among))
    if recovered:
        log.warning("k3load: %d attempt(s) recovered from worker spools", recovered)
    short = [w for w in short if not _sealed(workers.tallies[w], spool_dir)]
    spools.TAILS.forget(spool_dir)  # the run's spools are not looked at again
    problems = [f"{workers.describe(w)} did not complete within {timeout_s:.0f} s: turns it finished later "
                "may be missing from records.jsonl" for w in short]
    for problem in problems:
        log.error("k3load: %s", problem)
    if workers.tallies:
        run.events.event(Event.WORKER_SPOOLS, workers=len(workers.tallies), final=len(workers.tallies) - len(short),
                         not_final=[workers.describe(w) for w in short], waited_s=timeout_s,
                         read_after_locust_quit=pumped[0],
                         by_worker={w: asdict(t) for w, t in sorted(workers.tallies.items())})
    return problems


def _spool_name(name: Any) -> str | None:
    """A spool is a file directly under DIR/spool/ named as WorkerLink names it, or none: a name from whoever
    joined the worker port (`../../..`, `/etc/...`) never makes the master read another file."""
    if isinstance(name, str) and SPOOL_NAME.fullmatch(name):
        return name
    if name is not None:
        log.warning("k3load: a worker named a spool that is not one (%.80r): its spool is not read", name)
    return None


def _sealed(tally: Tally, spool_dir: Path) -> bool:
    return bool(tally.spool) and spools.is_final(spool_dir / str(tally.spool))


def _reconcile(workers: Workers, write: Callable[[str, str], bool], spool_dir: Path,
               written: Callable[[set[str]], set[str]]) -> int:
    """Attempts that reached the spool of a worker whose messages fell short, but not the master, are added
    (none twice: `written` says which of the spools' attempts the records file holds already, and a spool's
    line is added once). A complete worker's spool is not read: its messages brought everything. Memory: the
    short spools' attempt ids, at the end and only where a worker fell short."""
    short = [t for _w, t in sorted(workers.tallies.items())
             if t.spool and not t.complete and (spool_dir / str(t.spool)).exists()]
    if not short:
        return 0
    workers.during_reconcile = set()
    try:
        missing = {attempt_id for tally in short
                   for attempt_id, _ in spools.attempt_lines(spool_dir / str(tally.spool))}
        missing -= written(missing)
        added = 0
        for tally in short:
            for attempt_id, line in spools.attempt_lines(spool_dir / str(tally.spool)):
                if attempt_id in missing and attempt_id not in workers.during_reconcile and write(attempt_id, line):
                    missing.discard(attempt_id)
                    workers.recovered.add(attempt_id)
                    tally.recovered += 1
                    added += 1
        return added
    finally:
        workers.during_reconcile = None


class _AttemptId(msgspec.Struct):
    attempt_id: str = ""


_ID = msgspec.json.Decoder(_AttemptId)


def written_ids(run: OpenRun, among: set[str]) -> set[str]:
    """Those of `among` that the run's records file holds (flushed first, so every line written is read). A
    line that is not a record (torn, not JSON) holds none."""
    run.records.flush()
    found: set[str] = set()
    for line in lines(records_file(run.run_dir)):
        if not line.endswith("\n"):
            continue
        try:
            attempt_id = _ID.decode(line).attempt_id
        except msgspec.DecodeError:
            continue
        if attempt_id in among:
            found.add(attempt_id)
    return found
