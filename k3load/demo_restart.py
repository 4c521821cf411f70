"""`python -m k3load.demo_restart STATE`: the demo's --k3-restart-cmd. Stops the sim `k3load demo` runs and
starts it again with the same arguments on the same port, its output appended to the same log.

Why a command of the demo's own: the demo owns the sim's process, so it can rehearse what an operator's
hook does (`systemctl restart vllm`): the restart drill (the plan's `restart` stage) restarts a RUNNING sim,
and the crash path (a sim that died of an injected OOM) starts a stopped one; this command does both.

STATE is a JSON file the demo writes (`SimState`: the sim's pid, port, arguments and log). A lock beside
it (STATE.lock) orders a restart and the demo's `close`: once closed no restart starts a sim, and `close`
stops the one running, so the demo leaves no sim behind whatever happened to the run. Only a process
that is a `k3load sim` is ever signalled (a pid the system gave to another process is left alone).

Prints one line per step (the drill keeps them in DIR/restart-drill.log); exit 0 once the new sim
listens, 1 when it did not start or the demo has ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from k3load.yamlfile import one_line

LISTENING = "listening on "


@dataclasses.dataclass
class SimState:
    """The demo's sim as its restart command sees it; `closed` once the demo has stopped it for good."""

    pid: int
    port: int
    args: list[str]
    log: str
    closed: bool = False


def save(path: Path, state: SimState) -> None:
    """Atomically (temp + rename): a restart never reads half a state."""
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(dataclasses.asdict(state)))
    temp.replace(path)


def load(path: Path) -> SimState:
    return SimState(**json.loads(path.read_text()))


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    with open(f"{path}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes
        yield


def is_sim(pid: int) -> bool:
    """`pid` is a live `k3load sim` (not gone, not a zombie, not a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z" and b"k3load" in argv and b"sim" in argv


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; returns once the sim is gone (its port is free again)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not is_sim(pid):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + timeout_s
        while is_sim(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def start(state: SimState, timeout_s: float = 30.0) -> int:
    """A new sim with the state's arguments on its port; its pid once it listens, else RuntimeError."""
    log = Path(state.log)
    offset = log.stat().st_size if log.exists() else 0
    with log.open("ab") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "k3load", "sim", *state.args, "--port", str(state.port)],
                                stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with log.open("rb") as handle:
            handle.seek(offset)
            text = handle.read().decode(errors="replace")
        if LISTENING in text:
            return proc.pid
        if proc.poll() is not None:
            raise RuntimeError(f"the sim exited {proc.returncode}: {one_line(text)[-500:]}")
        time.sleep(0.05)
    stop(proc.pid)
    raise RuntimeError(f"the sim did not listen within {timeout_s:g} s (see {log})")


def restart(path: Path) -> int:
    """Stop the state's sim (if it runs) and start it again on the same port; 0 once it listens."""
    with locked(path):
        state = load(path)
        if state.closed:
            print("k3load demo restart: the demo has ended; no sim started", flush=True)
            return 1
        running = is_sim(state.pid)
        stop(state.pid)
        print(f"k3load demo restart: sim pid {state.pid} {'stopped' if running else 'was not running'}", flush=True)
        try:
            pid = start(state)
        except RuntimeError as exc:
            print(f"k3load demo restart: {exc}", flush=True)
            return 1
        save(path, dataclasses.replace(state, pid=pid))
    print(f"k3load demo restart: sim pid {pid} listening on port {state.port}", flush=True)
    return 0


def close(path: Path) -> None:
    """The demo's end: no restart after this, and the sim running now (first or restarted) is stopped."""
    with locked(path):
        state = load(path)
        save(path, dataclasses.replace(state, closed=True))
        stop(state.pid)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m k3load.demo_restart STATE", file=sys.stderr)
        return 2
    return restart(Path(argv[0]))


if __name__ == "__main__":
    sys.exit(main())
