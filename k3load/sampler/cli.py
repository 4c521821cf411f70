"""`k3load sample`: run the side sampler on its own until Ctrl-C, SIGTERM or --duration.

Why a standalone command: the sampler must also run where Locust does not — next to the server on a
GPU node (NVML sees only local GPUs), during a manual restart drill, or before a run to record the
idle baseline. It writes the same files into the same run directory layout as the Locust run.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from k3load.sampler.loop import Sampler


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-url", required=True, help="vLLM /metrics URL, e.g. http://127.0.0.1:8000/metrics "
                        "(/health is polled on the same host)")
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
    parser.add_argument("--out", type=Path, required=True, help="run directory to write into")


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("k3load sample: --interval must be > 0")
        return 2
    sampler = Sampler(args.out, args.metrics_url, gpu_metrics_urls=args.gpu_metrics_url, interval_s=args.interval,
                      nvml="auto" if args.nvml == "auto" else None, server_log=args.server_log,
                      server_log_cmd=args.server_log_cmd, api_key=os.environ.get(args.api_key_env) or None)
    done = threading.Event()
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
    return 0


def _setter(done: threading.Event) -> Callable[[int, FrameType | None], None]:
    def handler(_signum: int, _frame: FrameType | None) -> None:
        done.set()

    return handler
