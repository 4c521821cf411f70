"""`k3load sample`: run the side sampler on its own until Ctrl-C, SIGTERM or --duration.

Why a standalone command: the sampler must also run where Locust does not — next to the server on a
GPU node (NVML sees only local GPUs), during a manual restart drill, or before a run to record the
idle baseline. It writes the same files into the same run directory layout as the Locust run.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from k3load.client.access import Secrets, Tls, access_headers, access_problem, add_access_arguments
from k3load.client.origin import plain_http_warning
from k3load.disk_full import failure_head
from k3load.rundir import WriteGuard
from k3load.sampler.loop import Sampler


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                        help="vLLM /metrics URL, e.g. http://127.0.0.1:8000/metrics; repeatable (replicas, "
                        "data-parallel ranks: one loop each)")
    parser.add_argument("--health-url", metavar="URL",
                        help="the API's /health (default: next to the first --metrics-url); the API key goes only "
                        "to URLs on this URL's host and port")
    parser.add_argument("--scrape-timeout", type=float, metavar="S",
                        help="per-request timeout of /metrics, /health and Prometheus queries "
                        "(default: the interval, at least 2 s, at most 10 s)")
    parser.add_argument("--prometheus-url", metavar="URL",
                        help="read the vllm:* series back from this Prometheus (its /api/v1/query_range)")
    parser.add_argument("--prometheus-selector", default="", metavar="LABELS",
                        help='extra label matchers for the Prometheus query, e.g. job="vllm",cluster="a"')
    parser.add_argument("--gpu-metrics-url", action="append", default=[], metavar="URL",
                        help="a dcgm-exporter /metrics URL, one per node (repeatable)")
    parser.add_argument("--nvml", choices=("auto", "off"), default="auto",
                        help="read local GPUs through NVML when a driver is found (default: auto)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between readings (default: 1.0)")
    log = parser.add_mutually_exclusive_group()
    log.add_argument("--server-log", type=Path, metavar="PATH", help="follow the server's log file")
    log.add_argument("--server-log-cmd", metavar="CMD",
                     help="run CMD and follow its output, e.g. 'kubectl logs -f POD'")
    parser.add_argument("--duration", type=float, help="stop after S seconds (default: until Ctrl-C or SIGTERM)")
    parser.add_argument("--api-key-env", default="K3_API_KEY", metavar="VAR",
                        help="environment variable holding the bearer token for /metrics and /health "
                        "(default: K3_API_KEY; read from the environment so it never shows in ps or logs)")
    add_access_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="run directory to write into")


def run(args: argparse.Namespace) -> int:
    args.header = access_headers(args)  # --header, else $K3_HEADER
    problem = _problem(args)
    if problem:
        print(f"k3load sample: {problem}", file=sys.stderr)
        return 2
    secrets = Secrets.parse(os.environ.get(args.api_key_env) or None, args.header)
    done = threading.Event()
    stopped: list[str] = []  # why sampling stopped (a write that failed): exit 2
    guard = WriteGuard(lambda path, exc: _write_failed(args.out, path, exc, done, stopped))
    sampler = Sampler(args.out, args.metrics_url, gpu_metrics_urls=args.gpu_metrics_url, interval_s=args.interval,
                      nvml="auto" if args.nvml == "auto" else None, server_log=args.server_log,
                      server_log_cmd=args.server_log_cmd, api_key=secrets.api_key, headers=dict(secrets.headers),
                      tls=Tls(args.ca_bundle, args.insecure),
                      timeout_s=args.scrape_timeout, health_url=args.health_url,
                      prometheus_url=args.prometheus_url, prometheus_selector=args.prometheus_selector,
                      guard=guard)
    if warning := plain_http_warning(sampler.health_url or sampler.metrics_url or "", bool(secrets)):
        print(warning, file=sys.stderr)  # the key's origin only: it goes nowhere else
    previous = signal.signal(signal.SIGTERM, _setter(done))
    try:
        sampler.start()
        print(f"k3load sample: writing {args.out} every {args.interval:g} s "
              f"({'until ' + format(args.duration, 'g') + ' s' if args.duration else 'Ctrl-C or SIGTERM to stop'})",
              flush=True)
        done.wait(args.duration)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        summary = sampler.stop()
    print(f"k3load sample: {summary.get('scrapes', 0)} scrapes ({summary.get('scrape_failures', 0)} failed), "
          f"{summary.get('gpu_rows', 0)} GPU readings, {summary.get('health_transitions', 0)} health transitions "
          f"-> {args.out}", flush=True)
    return 2 if stopped else 0


def _write_failed(out: Path, path: Path, exc: OSError, done: threading.Event, stopped: list[str]) -> None:
    """A file could not be written (a full disk): one line, the sampler stops, exit 2; what it wrote stays."""
    stopped.append(f"{failure_head(out, path, exc)}: sampling stopped at {time.strftime('%H:%M:%S')}; what was "
                   "written up to there is intact")
    print(f"k3load sample: {stopped[0]}", file=sys.stderr, flush=True)
    done.set()


def _problem(args: argparse.Namespace) -> str | None:
    """The first unusable option, named with the value given (one line, exit 2, nothing started)."""
    if args.interval <= 0:
        return f"--interval must be > 0, got {args.interval:g}"
    if args.scrape_timeout is not None and args.scrape_timeout <= 0:
        return f"--scrape-timeout must be > 0, got {args.scrape_timeout:g}"
    if args.duration is not None and args.duration <= 0:
        return f"--duration must be > 0, got {args.duration:g}"
    if not (args.metrics_url or args.prometheus_url):
        return "give --metrics-url (repeatable) or --prometheus-url"
    if problem := access_problem(os.environ.get(args.api_key_env) or None, args.header, args.ca_bundle,
                                 args.insecure, prefix="--"):
        return problem
    if args.out.exists() and not args.out.is_dir():
        return f"--out {args.out}: not a directory"
    return None


def _setter(done: threading.Event) -> Callable[[int, FrameType | None], None]:
    def handler(_signum: int, _frame: FrameType | None) -> None:
        done.set()

    return handler
