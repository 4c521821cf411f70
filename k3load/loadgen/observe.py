"""The observation side of a Locust run: the compat precheck before the first request, the side
sampler during the run, the judgment after it. Master/local runner only (workers only send load).

Why here: `test_start` and `quitting` are the seams; the work itself is in k3load.precheck,
k3load.sampler and k3load.analysis, each usable without Locust.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3load.analysis.pillars.pillar import RECOVERY_HOLD_CAP_S
from k3load.clock import wall_clock
from k3load.disk_full import free_bytes, mount_of, size_text, space_needed
from k3load.events import Event
from k3load.loadgen.drain import StageDrain, server_reader
from k3load.loadgen.inputs import node_files
from k3load.loadgen.open_run import OpenRun
from k3load.loadgen.options import metrics_urls, run_access
from k3load.loadgen.recovery import RecoveryHold
from k3load.loadgen.redact_lines import copy_redacted
from k3load.loadgen.restart_drill import RestartDrill
from k3load.precheck import run_precheck
from k3load.rundir import JsonlLog
from k3load.sampler import Sampler
from k3load.workload.plan import Stage

log = logging.getLogger("k3load")


def precheck(run: OpenRun, stop: Callable[[], None]) -> bool:
    """compat.json into the run directory, before the first request; True when no load runs (`stop` called). A
    deployment that fails the recipe's rules is a verdict (`rebuild`), recorded here; a precheck that cannot run
    (a recipe that is not valid, an input file that cannot be read) raises: a harness error, the run stops before
    any load (the recipe and the files are checked at `init` already; this is the web UI's and a race's path)."""
    opts, run_dir, host = run.target.options, run.run_dir, run.target.host
    secrets, tls = run_access(opts)
    files = node_files(opts)  # NODE=PATH entries, one per node (checked at init already)
    compat = run_precheck(run_dir, Path(opts.k3_recipe), host,
                          container_info=files["k3_container_info"],
                          host_inventories=[Path(p) for p in opts.k3_host_inventory or []],
                          startup_log=files["k3_startup_log"], image=opts.k3_image or None,
                          custom_build=_path(opts.k3_custom_build), secrets=secrets, tls=tls,
                          use_local_nvml=opts.k3_nvml != "off",
                          metrics_url=next(iter(metrics_urls(opts, host)), None))
    failed = [r["id"] for r in compat.get("rules", []) if r.get("status") == "fail"]
    # rebuild is decided first (analysis/verdict.py): no load on a deployment already judged to need rebuilding
    load_skipped = bool(compat.get("status") == "fail" and not opts.k3_load_after_rebuild)
    run.events.event(Event.PRECHECK, status=compat.get("status"), failed=failed, load_skipped=load_skipped)
    log.info("k3load precheck: %s%s", compat.get("status"), f" (failed: {', '.join(failed)})" if failed else "")
    if load_skipped:
        log.warning("k3load: the precheck's verdict is rebuild: the run stops before any load (the reasons, the "
                    "checklist and exit 4); --k3-load-after-rebuild runs the plan anyway")
        stop()  # without a plan shape; a shape ends at its next tick
    disk_space(run)
    return load_skipped


def disk_space(run: OpenRun) -> None:
    """Warn (a console line and `disk_space_low`) when the run directory's filesystem has less free space than
    the plan may write (k3load.disk_full.space_needed); the run goes on, and stops if the disk fills."""
    opts, run_dir, plan = run.target.options, run.run_dir, run.plan
    free = free_bytes(run_dir)
    if free is None:
        return
    sources = len(metrics_urls(opts, run.target.host)) or 1
    needed = space_needed(plan, opts.k3_sample_interval, sources, len(getattr(opts, "k3_gpu_metrics_url", None)
                                                                      or []) or sources)
    if free >= needed:
        return
    point, fstype = mount_of(run_dir)
    log.warning("k3load: %s has %s free (%s at %s) and the plan %s may write up to %s: the run stops when the disk "
                "fills; free space or give another --k3-out", opts.k3_out, size_text(free), fstype, point, plan.name,
                size_text(needed))
    run.events.event(Event.DISK_SPACE_LOW, free_bytes=free, needed_bytes=needed, filesystem=fstype,
                     mount_point=point)


def start_sampler(run: OpenRun) -> Sampler:
    """/health stays on the target (the API's health); metrics (and DCGM_FI_* on them, unless
    --k3-gpu-metrics-url) come from every source given."""
    opts, host = run.target.options, run.target.host.rstrip("/")
    secrets, tls = run_access(opts)
    sources = metrics_urls(opts, host)
    gpu_urls = list(opts.k3_gpu_metrics_url or []) or sources  # DCGM_FI_* on a metrics body: read from it
    return Sampler(run.run_dir, sources, gpu_metrics_urls=gpu_urls, clock=wall_clock(),
                   interval_s=opts.k3_sample_interval, nvml="auto" if opts.k3_nvml != "off" else None,
                   server_log=_path(opts.k3_server_log), server_log_cmd=opts.k3_server_log_cmd or None,
                   api_key=secrets.api_key, headers=dict(secrets.headers), tls=tls, events=run.events,
                   health_url=f"{host}/health",
                   timeout_s=getattr(opts, "k3_scrape_timeout", 0) or None,
                   prometheus_url=getattr(opts, "k3_prometheus_url", "") or None,
                   prometheus_selector=getattr(opts, "k3_prometheus_selector", "") or "",
                   guard=run.guard).start()


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


class Restarter:
    """Runs the configured restart command when the sampler reports `server_down` (the spec's restart
    check: after a crash the process must come back and hold the same load). Bounded: at most
    `max_restarts` per run, one at a time; every start is an event in `events`, its output in `run_dir`.
    `drilling`: the restart drill has the server down on purpose (no crash to restart after)."""

    def __init__(self, events: JsonlLog, run_dir: Path, command: str, max_restarts: int,
                 drilling: Callable[[], bool] = lambda: False) -> None:
        self.events, self.run_dir, self.command, self.max_restarts = events, run_dir, command, max_restarts
        self.drilling = drilling
        self.started = 0
        self._running: subprocess.Popen[bytes] | None = None

    def __call__(self, record: dict[str, Any]) -> None:
        if record.get("event") != Event.SERVER_DOWN or record.get("first_poll"):
            return
        if self.drilling():
            return  # the restart drill took the server down on purpose and is bringing it back itself
        if self.started >= self.max_restarts or (self._running and self._running.poll() is None):
            return
        self.started += 1
        log_path = self.run_dir / f"restart-{self.started}.log"
        self._running = subprocess.Popen(["bash", "-c", self.command], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        copy_redacted(self._running, log_path)
        self.events.event(Event.RESTART_COMMAND, attempt=self.started, pid=self._running.pid, log=log_path.name)
        log.warning("k3load: server down, restart command started (%d of %d)", self.started, self.max_restarts)


def watch_restarts(run: OpenRun, drilling: Callable[[], bool]) -> Restarter | None:
    """Master/local with --k3-restart-cmd: the crash path's restarter, listening to the run's events."""
    opts = run.target.options
    if not opts.k3_restart_cmd:
        return None
    restarter = Restarter(run.events, run.run_dir, opts.k3_restart_cmd, opts.k3_max_restarts, drilling)
    run.events.listeners.append(restarter)
    return restarter


def watch_recoveries(run: OpenRun, stage: Callable[[], Stage | None], drilling: Callable[[], bool]) -> RecoveryHold:
    """Master/local: after a crash, once the server is back, the crash stage's load again (k3load.loadgen.recovery).
    Listens before the restarter: a down's count of restarts is taken before the command it starts for it."""
    listeners = run.events.listeners
    restarter = next((x for x in listeners if isinstance(x, Restarter)), None)
    hold = RecoveryHold(run.events, stage=stage, restarts=lambda: restarter.started if restarter else 0,
                        drilling=drilling, hold_s=run.limits["resources"].get("recovery_hold_s"),
                        cap_s=RECOVERY_HOLD_CAP_S, max_holds=run.target.options.k3_max_restarts)
    listeners.insert(listeners.index(restarter) if restarter is not None else len(listeners), hold)
    return hold


def stage_ends(run: OpenRun) -> tuple[StageDrain, RestartDrill | None]:
    """Master/local: the drain window after each plan stage (bounded by the plan's resources.max_drain_s)
    and, with --k3-restart-cmd, the restart stage's drill (bounded by resources.max_restart_s)."""
    limits = run.limits["resources"]
    command = run.target.options.k3_restart_cmd
    crash = next((x for x in run.events.listeners if isinstance(x, Restarter)), None)
    drill = RestartDrill(run.events, run.run_dir, run.target, command, limits["max_restart_s"],
                         crash_restarts=lambda: crash.started if crash else 0) if command else None
    return StageDrain(run.events, limits["max_drain_s"], server_reader(run.target)), drill
