"""k3load's Locust options (also settable in `[tool.locust]`, a locust.conf or `LOCUST_*`/K3_* env).

`run_access(parsed)` turns the access options into what every request needs (the key, gateway headers,
TLS trust) and makes the process's file writers and log handlers redact those secrets.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from k3load.analysis.capacity_cli import add_planner_arguments
from k3load.client.access import RESERVED_HEADERS as ACCESS_RESERVED
from k3load.client.access import Secrets, Tls, header_lines, is_header_name, parse_header
from k3load.client.body import MAX_BODY_BYTES
from k3load.client.sse import MAX_LINE_BYTES
from k3load.command_name import withheld
from k3load.loadgen import held_secrets
from k3load.precheck.node_files import NodeFilesAction
from k3load.rundir import redact_in_files, scrub
from k3load.sampler.fetch import redact_url

TRANSPORTS = ("geventhttpclient", "httpx")
# The k3load options a web UI visitor may set when starting a test (Locust's own form fields aside): none of
# them runs a command, names a file, a URL or a secret, or changes what the verdict means. Every other --k3-*
# option is fixed at start: hidden from the page and refused in a start request (k3load.loadgen.ui_guard).
LIVE_OPTIONS = frozenset({"k3_plan", "k3_seed", "k3_model", "k3_transport", "k3_sample_interval",
                          "k3_max_body_bytes", "k3_max_line_bytes"})
SAFE_WEB_HOST = "127.0.0.1"  # Locust binds its web UI and worker port to every interface by default, no login


def positive_bytes(text: str) -> int:
    """argparse type for a byte cap: an error names the option (argparse adds it) and the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of bytes > 0, got {text!r}")
    return value


def header(text: str) -> str:
    """argparse type for --k3-header (and K3_HEADER): one header, several one a line, or @FILE (as curl:
    one a line, blank lines and # comments skipped), read and checked here; kept as their `Name: value`
    lines, one string (Secrets.parse splits it). Errors name the file and line or the header, never a value."""
    try:
        return "\n".join(header_lines([text]))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# Headers a request's session id may not take: the key's, and those the harness sets itself
SESSION_RESERVED = ACCESS_RESERVED | {"authorization"}


def session_header(text: str) -> str:
    """argparse type for --k3-session-header: a header name (RFC 9110 token), none of the reserved ones."""
    name = text.strip()
    if name and not is_header_name(name):
        raise argparse.ArgumentTypeError(f"not a header name: {text!r}")
    if name.lower() in SESSION_RESERVED:
        raise argparse.ArgumentTypeError(f"{name} is sent by k3load itself: name the header your router keys on")
    return name


def add_options(parser: Any) -> None:
    group = parser  # Locust's own parser: its is_secret / include_in_web_ui work only there, not in groups
    group.add_argument("--k3-out", default="runs/latest", env_var="K3_OUT",
                       help="run directory: records, timelines, evidence and reports go here")
    group.add_argument("--k3-plan", default="smoke", env_var="K3_PLAN",
                       help="stage plan: a name under plans/ or a YAML file")
    group.add_argument("--k3-scenarios", default="scenarios/*.yaml", env_var="K3_SCENARIOS",
                       help="glob of scenario files to play")
    group.add_argument("--k3-seed", type=int, default=0, env_var="K3_SEED",
                       help="seed for scenario choice (same seed, same sequence per user)")
    group.add_argument("--k3-api-key", default="", env_var="K3_API_KEY", is_secret=True,
                       help="API key sent as a bearer token; never written to logs, records or reports")
    _access_options(group)
    group.add_argument("--k3-model", default="", env_var="K3_MODEL",
                       help="served model name (default: the first of the server's /v1/models)")
    group.add_argument("--k3-transport", default="geventhttpclient", choices=TRANSPORTS, env_var="K3_TRANSPORT",
                       help="streaming transport (geventhttpclient times first tokens more tightly)")
    group.add_argument("--k3-run-id", default="", env_var="K3_RUN_ID", include_in_web_ui=False,
                       help="run id (default: generated); salts per-run prefixes")
    group.add_argument("--k3-judge", default="", env_var="K3_JUDGE", help="who signs the record (report field)")
    group.add_argument("--k3-max-body-bytes", type=positive_bytes, default=MAX_BODY_BYTES, env_var="K3_MAX_BODY_BYTES",
                       help="most bytes of a whole response body kept (a streamed answer: characters of its text); "
                       "past it the attempt is malformed and the rest only counted and hashed")
    group.add_argument("--k3-max-line-bytes", type=positive_bytes, default=MAX_LINE_BYTES, env_var="K3_MAX_LINE_BYTES",
                       help="most bytes of one SSE line kept; a longer line makes the attempt malformed "
                       "(its length and sha256 in the error)")
    group.add_argument("--k3-manual", action="store_true", default=False, env_var="K3_MANUAL",
                       include_in_web_ui=False,
                       help="no plan shape: the user count set in the web UI (or -u) drives the load, each change "
                       "a stage manual-N; the plan gives only its thresholds and settings")
    group.add_argument("--k3-accept-limited", action="store_true", default=False, env_var="K3_ACCEPT_LIMITED",
                       help="exit 0 for a `limited` verdict as for `go`")
    group.add_argument("--k3-reference", default="", env_var="K3_REFERENCE", metavar="DIR",
                       help="a judged run directory to agree with: the agent pillar is judged also on tool-call "
                       "trigger F1 and schema accuracy against it (thresholds: the plan's agent_api); its run id, "
                       "manifest hash and profile go to reference.json in the run directory")
    group.add_argument("--k3-worker-spool", default="auto", choices=("auto", "off"), env_var="K3_WORKER_SPOOL",
                       include_in_web_ui=False,
                       help="worker: also keep each record in a spool under the master's run directory where this "
                       "worker reaches it (--processes, a shared volume), read at the end for any record whose "
                       "message did not arrive; off: Locust messages only. Read from the worker's own command line "
                       "or environment")
    _observation_options(group)
    add_planner_arguments(group, "--k3-")  # the capacity plan's targets (analysis/decision/capacity.py, capacity.json)
    group.add_argument("--k3-secrets-check", default="", include_in_web_ui=False,
                       help="set by the master, never by hand: a salted PBKDF2-SHA256 check of the target's origin, "
                       "key and headers, relayed to workers in their place (each worker reads its own K3_API_KEY / "
                       "K3_HEADER and refuses the run when they differ)")
    for action in parser._actions:  # every option not declared live is fixed at start (k3load.loadgen.ui_guard)
        if action.dest.startswith("k3_") and action.dest not in LIVE_OPTIONS:
            action.include_in_web_ui = False
    # the web UI and the workers' port on loopback unless --web-host / --master-bind-host say otherwise
    parser.set_defaults(web_host=SAFE_WEB_HOST, master_bind_host=SAFE_WEB_HOST)


def _access_options(group: Any) -> None:
    """How to reach a protected target: a gateway's headers and TLS trust (the key is --k3-api-key)."""
    group.add_argument("--k3-header", action="append", default=[], type=header, env_var="K3_HEADER",
                       is_secret=True, metavar="'NAME: VALUE'/@FILE",
                       help="extra header on every request to the target (repeatable), e.g. a gateway's token; "
                       "@FILE reads one a line (blank lines and # comments skipped, as curl); K3_HEADER holds one a "
                       "line, or @FILE (a worker reads its own); its value is a secret: never written to logs, "
                       "records or reports, never sent to workers")
    group.add_argument("--k3-session-header", default="", type=session_header, env_var="K3_SESSION_HEADER",
                       help="header a session-affinity router keys on: each conversation sends its own stable id in "
                       "it (every turn, retry and cache-control twin of one conversation alike), so they meet one "
                       "replica; not a secret, never the key's or a gateway header's name (default: none sent)")
    group.add_argument("--k3-ca-bundle", default="", env_var="K3_CA_BUNDLE",
                       help="PEM file of CA certificates trusted for an https target, on top of the system's "
                       "(a private CA)")
    group.add_argument("--k3-insecure", action="store_true", default=False, env_var="K3_INSECURE",
                       help="no TLS certificate verification at all (said in the log and in run.json)")


def _observation_options(group: Any) -> None:
    group.add_argument("--k3-recipe", default="recipes/kimi-k3.yaml", env_var="K3_RECIPE",
                       help="compat recipe: recipes/kimi-k3.yaml (production) or recipes/local-dev.yaml (sim, CPU)")
    group.add_argument("--k3-container-info", action=NodeFilesAction, default="", env_var="K3_CONTAINER_INFO",
                       metavar="[NODE=]FILE",
                       help="saved `vllm collect-env` output from inside the serving container; per node: "
                       "NODE=FILE, repeatable (NODE as its --k3-host-inventory names it; each node judged on its "
                       "own); a bare FILE: a single node. K3_CONTAINER_INFO holds several NODE=FILE one a line or "
                       "comma-separated")
    group.add_argument("--k3-host-inventory", action="append", default=[], env_var="K3_HOST_INVENTORY",
                       help="per-node GPU inventory JSON (repeatable)")
    group.add_argument("--k3-startup-log", action=NodeFilesAction, default="", env_var="K3_STARTUP_LOG",
                       metavar="[NODE=]FILE",
                       help="the server's startup log; per node: NODE=FILE, repeatable (as --k3-container-info); a "
                       "bare FILE: a single node. K3_STARTUP_LOG holds several NODE=FILE one a line or "
                       "comma-separated")
    group.add_argument("--k3-image", default="", env_var="K3_IMAGE", help="container image deployed (repo:tag)")
    group.add_argument("--k3-custom-build", default="", env_var="K3_CUSTOM_BUILD",
                       help="record of a custom build (commit, deps, build time, reproduction, rollback image)")
    group.add_argument("--k3-gpu-metrics-url", action="append", default=[], env_var="K3_GPU_METRICS_URL",
                       help="dcgm-exporter /metrics, one per node (repeatable; default: the metrics sources' bodies)")
    group.add_argument("--k3-nvml", default="auto", choices=("auto", "off"), env_var="K3_NVML",
                       help="read local GPUs through NVML when present")
    group.add_argument("--k3-sample-interval", type=float, default=1.0, env_var="K3_SAMPLE_INTERVAL",
                       help="seconds between /metrics, /health and GPU readings")
    _metrics_source_options(group)
    group.add_argument("--k3-server-log", default="", env_var="K3_SERVER_LOG",
                       help="server log file to follow (OOM / NCCL / CUDA lines become events)")
    group.add_argument("--k3-server-log-cmd", default="", env_var="K3_SERVER_LOG_CMD",
                       help="command whose output is the server log (e.g. kubectl logs -f POD)")
    group.add_argument("--k3-restart-cmd", default="", env_var="K3_RESTART_CMD",
                       help="command that restarts the server: after a crash (it went down), and on purpose at "
                            "the restart stage (the restart drill, the server up: it must restart a RUNNING server, "
                            "e.g. systemctl restart vllm, docker restart NAME)")
    group.add_argument("--k3-max-restarts", type=int, default=3, env_var="K3_MAX_RESTARTS",
                       help="at most this many restart commands per run")
    group.add_argument("--k3-load-after-rebuild", action="store_true", default=False,
                       env_var="K3_LOAD_AFTER_REBUILD",
                       help="run the plan's load even when the precheck's outcome is rebuild (by default the run "
                            "stops before any load: the reasons, the checklist and exit 4 in seconds); the verdict "
                            "stays rebuild, with the resource evidence beside it")


def _metrics_source_options(group: Any) -> None:
    """Where the engine's metrics are read when they are not at the target's own /metrics."""
    group.add_argument("--k3-metrics-url", action="append", default=[], env_var="K3_METRICS_URL",
                       help="vLLM /metrics to scrape, one per replica or rank (repeatable; default: the target's "
                       "/metrics); the API key goes only to those on the target's host and port")
    group.add_argument("--k3-scrape-timeout", type=float, default=0.0, env_var="K3_SCRAPE_TIMEOUT",
                       help="per-request timeout of /metrics, /health and Prometheus queries in seconds "
                       "(0: the sample interval, at least 2, at most 10)")
    group.add_argument("--k3-prometheus-url", default="", env_var="K3_PROMETHEUS_URL",
                       help="a Prometheus that scrapes the engines: their vllm:* series are read back over the run "
                       "(never sent the API key)")
    group.add_argument("--k3-prometheus-selector", default="", env_var="K3_PROMETHEUS_SELECTOR",
                       help='label matchers narrowing that query, e.g. job="vllm",cluster="a"')


SECRET_OPTIONS = ("k3_api_key",)
SECRET_VALUE_OPTIONS = ("k3_header",)  # "Name: value": the name is kept, the value masked
COMMAND_OPTIONS = ("k3_server_log_cmd", "k3_restart_cmd")  # only the program: arguments may hold tokens


def public_options(parsed: Any) -> dict[str, Any]:
    """Every option of the run with secrets replaced, for run.json: a header's name only, a command's
    program only (k3load.command_name.withheld). The key and headers held out of the options at `init`
    (k3load.loadgen.held_secrets) are said as if still there."""
    kept = held_secrets.held(parsed)
    held = {"k3_api_key": kept.api_key, "k3_header": list(kept.headers)}
    out: dict[str, Any] = {}
    for key, value in sorted(vars(parsed).items()):
        secret = key in SECRET_OPTIONS or any(word in key.lower() for word in ("key", "token", "password"))
        value = value or held.get(key, value)
        if key in SECRET_VALUE_OPTIONS:
            out[key] = [f"{parse_header(line)[0]}: ***" for line in header_lines(value or [])]
        elif key in COMMAND_OPTIONS:
            out[key] = withheld(value) if isinstance(value, (str, list)) else value
        elif secret:
            out[key] = "***" if value else ""
        elif (key.endswith("_url") or key == "host") and _plain(value):  # a URL may carry user:password@
            out[key] = [redact_url(v) for v in value] if isinstance(value, list) else \
                redact_url(value) if isinstance(value, str) and value else value
        elif _plain(value):
            out[key] = value
    return out


def _plain(value: Any) -> bool:
    if isinstance(value, list):
        return all(isinstance(v, (str, int, float)) for v in value)
    return isinstance(value, (str, int, float, bool, type(None)))


def metrics_urls(opts: Any, host: str | None) -> list[str]:
    """--k3-metrics-url as given, else the target's own /metrics (the precheck reads the first)."""
    given = list(getattr(opts, "k3_metrics_url", None) or [])
    return given or ([f"{host.rstrip('/')}/metrics"] if host else [])


def run_access(parsed: Any) -> tuple[Secrets, Tls]:
    """The key, the gateway headers and the TLS trust of this run, from the options; from here on this
    process's file writers (k3load.rundir) and log handlers redact those secrets, whatever a server
    echoes. Idempotent: called wherever a client is built."""
    kept = held_secrets.held(parsed)  # at `init` the secrets left the options (k3load.loadgen.held_secrets)
    secrets = Secrets.parse(getattr(parsed, "k3_api_key", "") or kept.api_key or None,
                            getattr(parsed, "k3_header", None) or list(kept.headers))
    tls = Tls(getattr(parsed, "k3_ca_bundle", "") or None, bool(getattr(parsed, "k3_insecure", False)))
    if secrets:
        redact_in_files(secrets)
        _redact_logs()
    return secrets, tls


class _RedactingFilter(logging.Filter):
    """A handler filter: a log line (and its traceback) with every secret the process knows replaced."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if (clean := scrub(message)) != message:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = scrub(logging.Formatter().formatException(record.exc_info))
        return True


_FILTER = _RedactingFilter()


def _redact_logs() -> None:
    """On every handler configured now (Locust's console and --logfile handlers included)."""
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for handler in {h for logger in loggers for h in logger.handlers}:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)


LOCUST_CSV_SUFFIXES = ("_stats.csv", "_stats_history.csv", "_failures.csv", "_exceptions.csv")


def locust_late_outputs(parsed: Any, run_dir: Path | None) -> list[str]:
    """Locust's own outputs that fall inside the run directory and that Locust keeps writing after our
    `quitting` listener signed the manifest (--csv tables, --json-file, --logfile): run.json lists them
    as `unsigned_files`, and the manifest leaves them out (they are Locust's live view, not evidence)."""
    prefix, paths = getattr(parsed, "csv_prefix", None), []
    if prefix:
        paths += [Path(prefix + suffix) for suffix in LOCUST_CSV_SUFFIXES]
    json_file, logfile = getattr(parsed, "json_file", None), getattr(parsed, "logfile", None)
    paths += [Path(json_file + ".json")] if json_file else []  # locust/stats.py save_stats_json adds ".json"
    paths += [Path(logfile)] if logfile else []
    if run_dir is None:
        return []
    inside = (p.resolve() for p in paths)
    return sorted(p.relative_to(run_dir).as_posix() for p in inside if p.is_relative_to(run_dir))
