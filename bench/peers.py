"""What k3load costs per streamed chunk and per request, and how late it sees first tokens, against its
peers measured in the same run on the same paced server.

Clients (`--peers`, default all): `k3load-locust` (the full worker path: `locust -f locustfiles/agent.py
--headless` with validation and records on), `k3load-client` (k3load.client alone), and the references
`vllm-bench` (`vllm bench serve` from the vLLM CPU venv), `guidellm` (0.8.1) and `aiperf` (0.13.0),
each peer in its own venv under K3LOAD_CACHE (installed on first use). A client that cannot be
installed or run is skipped with the reason printed.

Server: bench/paced_server.py, one per stream count, with an engine-step clock: every
`streams / rate` seconds one token chunk to every open stream, so each read holds one token (the
realistic case, costlier per chunk than a flood). Every response is `--tokens` token chunks long,
whatever the client asked for: the same workload shape for every client. Server, this script and its
/proc sampling on one CPU, the client on the other (`--no-pin` to share).

Measured interval: from `--warmup-s` after the server first holds (nearly) all the streams open, for
`--duration-s` (shorter if the client stops filling them). CPU = the client's process tree's user +
system seconds (/proc, children included: GuideLLM and AIPerf work in child processes) over that
interval, so start-up, data generation and final reports are left out. Per chunk: over the token
chunks the server wrote in the interval; per request: over the requests that ended in it.
First-token lateness: the client's receive time of the first token minus the server's write time (the
token carries it), for requests whose first token was written in the interval. Each peer's own
record is read: vLLM's start_times + ttfts (CLOCK_MONOTONIC), GuideLLM's first_token_iteration,
AIPerf's request_start_ns + TTFT matched by X-Request-ID; "n/a" with the reason where it cannot be.

Ratios: each k3load client over each peer (below 1: cheaper, or tighter).

Before/after: `--baseline DIR` also runs k3load's two clients from another tree (as NAME@base);
`--rounds N` alternates the clients N times and prints medians; `--tokens 16 128` fits the fixed
per-request cost. GuideLLM and AIPerf start slowly (30-70 s each here), so `--quick` leaves them out
unless `--peers` names them.

    .venv/bin/python bench/peers.py [--quick] [--streams 16 256] [--tokens 128] [--duration-s 15]
                                    [--peers k3load-locust k3load-client vllm-bench guidellm aiperf]
                                    [--baseline DIR] [--rounds N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.paced_server import read_stats  # noqa: E402
from bench.peer_clients import Client, FirstTokens, Load, baseline_clients, clients, tokenizer_dir  # noqa: E402
from bench.peers_report import FULL, LATE_SHARE_MS, Result, median_of_rounds, report  # noqa: E402
from bench.proc_cpu import process_cpu_s, tree_cpu_s  # noqa: E402

SAMPLE_S = 0.1
QUICK_PEERS = ["k3load-locust", "k3load-client", "vllm-bench"]
FILL_TIMEOUT_S = 60.0  # not FULL by then: measured at what it holds if at least half, else reported
EXIT_TIMEOUT_S = 120.0  # a peer still writing its results after the load: stopped then
LOW_SAMPLES = 3  # this many samples in a row below half the streams: the client has stopped filling them


@dataclass
class Sample:
    mono: float
    wall: float
    cpu_s: float
    chunks: float
    finished: float
    active: float
    server_cpu_s: float


# -- one server per stream count -------------------------------------------------------------------
@contextlib.contextmanager
def paced_server(streams: int, tokens: int, args: argparse.Namespace, work: Path, cpu: int | None
                 ) -> Iterator[tuple[str, mmap.mmap, int]]:
    """(url, stats map, pid) of a paced server for `streams` and `tokens`; stopped at exit."""
    stats_path, log = work / f"server-{streams}-{tokens}.stats", work / f"server-{streams}-{tokens}.log"
    step_ms = streams / args.rate * 1000
    cmd = [sys.executable, str(ROOT / "bench" / "paced_server.py"), "--step-ms", f"{step_ms:.4f}",
           "--tokens", str(tokens), "--streams", str(streams), "--stats", str(stats_path)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_pin(cpu))
    try:
        url = _wait_for_url(proc, log)
        with stats_path.open("rb") as handle:
            stats = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        yield url, stats, proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_for_url(proc: subprocess.Popen[bytes], log: Path) -> str:
    for _ in range(300):
        text = log.read_text(errors="replace")
        if "listening on " in text:
            return text.split("listening on ")[1].split()[0]
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"paced server did not start: {log.read_text(errors='replace')[-2000:]}")


def _pin(cpu: int | None) -> Callable[[], None] | None:
    return (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None


# -- one client ------------------------------------------------------------------------------------
def measure(client: Client, load: Load, args: argparse.Namespace, stats: mmap.mmap, server_pid: int,
            cpu: int | None) -> Result:
    """Start the client, find its measured interval while it runs, stop it (or let it finish)."""
    result = Result(client.name, load.streams, load.tokens)
    log = load.out / "client.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(client.env or {})}
    _post(f"{load.url}/bench/stagger")  # this client's first round staggered, whatever came before
    with log.open("wb") as out:
        proc = subprocess.Popen(client.command(load), cwd=client.cwd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=_pin(cpu))
    try:
        window = _window(proc, load.streams, args, stats, server_pid)
        if isinstance(window, str):
            result.error = f"{window}; log tail: {_tail(log)}"
            return result
        if client.stop == "kill":  # the answers whose first token was in the interval end before it is killed
            time.sleep(min(load.tokens * load.streams / args.rate + 1.0, 30.0))
        if client.stop == "term":
            os.killpg(proc.pid, signal.SIGTERM)
        if client.stop in ("term", "wait"):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(EXIT_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    first, last = window
    _costs(result, first, last)
    _lateness(result, client.first_tokens(load, _first_written(load.url)), first.wall, last.wall)
    return result


def _window(proc: subprocess.Popen[bytes], streams: int, args: argparse.Namespace, stats: mmap.mmap,
            server_pid: int) -> tuple[Sample, Sample] | str:
    """The measured interval's first and last samples, or why there is none. It starts `warmup_s`
    after the server first held FULL of the streams open and ends `duration_s` later, or at the last
    sample before the client let more than half of them close for LOW_SAMPLES samples in a row (a peer
    that finished its requests)."""
    full, started = math.ceil(streams * FULL), time.monotonic()
    filled_at: float | None = None
    first: Sample | None = None
    last: Sample | None = None
    low: list[Sample] = []
    while True:
        sample = _sample(proc.pid, stats, server_pid)
        if sample is None:  # exited: what was measured before stands
            if first is not None and last is not None and last.mono > first.mono:
                return first, last
            return "the client exited before its interval was measured"
        if filled_at is None:
            if sample.active >= full or (sample.mono - started > FILL_TIMEOUT_S and sample.active >= streams / 2):
                filled_at = sample.mono  # a client that cannot hold them all is measured at what it holds
            elif sample.mono - started > FILL_TIMEOUT_S:
                return f"never held half of {streams} streams open in {FILL_TIMEOUT_S:.0f} s"
        elif first is None:
            if sample.mono >= filled_at + args.warmup_s:
                first = last = sample
        elif sample.active < streams * 0.5:
            assert last is not None
            low.append(sample)  # a closed loop's gap between requests can catch one sample: a run of them ends it
            if len(low) >= LOW_SAMPLES:
                return (first, last) if last.mono > first.mono else "the client stopped filling its streams"
        else:
            low.clear()
            last = sample
            if sample.mono - first.mono >= args.duration_s:
                return first, sample
        time.sleep(SAMPLE_S)


def _sample(pid: int, stats: mmap.mmap, server_pid: int) -> Sample | None:
    cpu = tree_cpu_s(pid)
    chunks, _started, finished, active = read_stats(stats)
    if cpu is None:
        return None
    return Sample(time.monotonic(), time.time(), cpu, chunks, finished, active, process_cpu_s(server_pid) or 0.0)


def _costs(result: Result, first: Sample, last: Sample) -> None:
    seconds = last.mono - first.mono
    cpu, chunks, done = last.cpu_s - first.cpu_s, last.chunks - first.chunks, last.finished - first.finished
    result.window_s = seconds
    result.held = (first.active + last.active) / 2
    result.client_cpu = cpu / seconds
    result.server_cpu = (last.server_cpu_s - first.server_cpu_s) / seconds
    result.chunks_per_s = chunks / seconds
    result.us_per_chunk = cpu / chunks * 1e6 if chunks else None
    result.ms_per_request = cpu / done * 1e3 if done else None


def _lateness(result: Result, pairs: FirstTokens | str, start_wall: float, end_wall: float) -> None:
    if isinstance(pairs, str):
        result.late_note = pairs
        return
    late = sorted((received - written) * 1000 for written, received in pairs if start_wall <= written <= end_wall)
    if not late:
        result.late_note = f"no first token written in the interval among {len(pairs)} read back"
        return
    result.late_p50_ms = late[len(late) // 2]
    result.late_p99_ms = late[min(len(late) - 1, math.ceil(0.99 * len(late)) - 1)]
    # a late read joins the next engine step's token: the share later than LATE_SHARE_MS says how close a
    # client is to the edge where its p99 is a whole step late (1% of first tokens)
    result.late_over = sum(1 for ms in late if ms > LATE_SHARE_MS) / len(late)
    result.late_note = f"n={len(late)}, {result.late_over:.1%} > {LATE_SHARE_MS} ms"


def _post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=10) as resp:
        resp.read()


def _first_written(url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"{url}/bench/first-tokens", timeout=10) as resp:
            written: dict[str, float] = json.loads(resp.read())
            return written
    except (OSError, ValueError):
        return {}


def _tail(log: Path) -> str:
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return " | ".join(lines[-3:])[-400:] or "(empty)"


# -- the run and its table -------------------------------------------------------------------------
def run_all(args: argparse.Namespace, chosen: list[Client], work: Path, cpus: tuple[int | None, int | None]
            ) -> dict[tuple[int, int], list[Result]]:
    """Every chosen client at every stream count and token count, one server for each pair; with
    --rounds N the clients take turns N times (drift on a shared machine hits each alike) and each
    figure is the median of its rounds."""
    results: dict[tuple[int, int], list[Result]] = {}
    for streams in args.streams:
        for tokens in args.tokens:
            rounds: dict[str, list[Result]] = {c.name: [] for c in chosen}
            with paced_server(streams, tokens, args, work, cpus[0]) as (url, stats, server_pid):
                for number in range(args.rounds):
                    for client in chosen:
                        out = work / f"{client.name}-{streams}-{tokens}-{number}"
                        out.mkdir(parents=True, exist_ok=True)
                        # + the ramp to full streams and a margin; a peer's own clock may start before its streams fill
                        run_s = args.warmup_s + args.duration_s + (2.0 if client.kind == "k3load" else 6.0)
                        load = Load(url, streams, tokens, run_s, args.rate, out, tokenizer_dir())
                        print(f"  {client.name} at {streams} streams, {tokens} tokens ...", end="", flush=True)
                        began = time.monotonic()
                        rounds[client.name].append(measure(client, load, args, stats, server_pid, cpus[1]))
                        print(f" {time.monotonic() - began:.0f} s", flush=True)
                        _wait_idle(stats)
            results[streams, tokens] = [median_of_rounds(rs) for rs in rounds.values()]
    return results


def _wait_idle(stats: mmap.mmap, bound_s: float = 10.0) -> None:
    """The last client's streams closed on the server before the next client starts."""
    end = time.monotonic() + bound_s
    while read_stats(stats)[3] > 0 and time.monotonic() < end:
        time.sleep(0.1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 256], help="concurrent streams")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128],
                        help="token chunks per response (two or more: the fixed per-request cost is fitted)")
    parser.add_argument("--rate", type=float, default=10000, help="offered token chunks/s over all streams")
    parser.add_argument("--duration-s", type=float, default=15.0, help="measured interval per client")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="after the streams are full, before measuring")
    parser.add_argument("--rounds", type=int, default=1, help="clients take turns this many times (medians)")
    parser.add_argument("--peers", nargs="+", choices=list(clients()), help="clients to run (k3load's own "
                        "included; default all)")
    parser.add_argument("--quick", action="store_true", help="3 s intervals after 1 s of warm-up; without --peers only "
                        "k3load's two clients and vllm-bench (GuideLLM and AIPerf start slowly): ~2 min")
    parser.add_argument("--keep", type=Path, help="keep every client's outputs and logs here")
    parser.add_argument("--baseline", type=Path, help="also run k3load's two clients from this tree (e.g. `git archive "
                        "HEAD | tar -x -C DIR`), as k3load-locust@base and k3load-client@base")
    parser.add_argument("--no-pin", action="store_true", help="do not pin server and client to separate CPUs")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration_s, args.warmup_s = 3.0, 1.0
    args.peers = args.peers or (QUICK_PEERS if args.quick else list(clients()))
    if min(args.streams) < 1 or min(args.tokens) < 2 or args.rate <= 0 or args.duration_s <= 0:
        parser.error("streams, rate and duration must be positive, tokens at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    first_two = sorted(os.sched_getaffinity(0))[:2]
    cpus: tuple[int | None, int | None] = (first_two[0], first_two[1]) if pin else (None, None)
    if pin:
        os.sched_setaffinity(0, {first_two[0]})  # this script's sampling shares the server's CPU, not the client's
    table = clients()
    wanted = [table[name] for name in args.peers]
    if args.baseline:
        base = {c.name.split("@")[0]: c for c in baseline_clients(args.baseline.resolve())}
        wanted = [x for c in wanted for x in ([c, base[c.name]] if c.name in base else [c])]
    chosen, skipped = [], {}
    for client in wanted:
        why = client.prepare()
        if why:
            skipped[client.name] = why
        else:
            chosen.append(client)
    where = f"server on CPU {cpus[0]}, clients on CPU {cpus[1]}" if pin else "unpinned"
    tokens = "/".join(map(str, args.tokens))
    print(f"paced server: {args.rate:,.0f} token chunks/s offered over all streams, {tokens} tokens/request, "
          f"{args.warmup_s:g} s warm-up + {args.duration_s:g} s measured per client; {where}; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory(prefix="k3load-peers-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = run_all(args, chosen, work, cpus)
    report(results, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
