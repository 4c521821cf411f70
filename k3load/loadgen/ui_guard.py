"""What a web UI visitor may change: users, rates, the run time, the classes and a shipped plan. Nothing else.

    refusal(form, start_host, plans_dir)   for POST /swarm: None, or the one-line reason it is refused
    no_workers_refusal(workers)           for POST /swarm on a master: refused while no worker is connected
    user_settings_refusal(settings, ...)   for POST /user (the class picker's per-class settings)
    exposure_warnings(parsed, web_ui)      at start: what listens beyond loopback for anyone who reaches it

Why an allow-list: Locust's `POST /swarm` sets *any* parsed option named in its form (locust/web.py: `case _ if
key in parsed_options_dict`), its own included (`--html`, `--csv`, `--logfile` choose where it writes), and
k3load re-reads its options at every test start: `--k3-server-log-cmd` and `--k3-restart-cmd` run in a shell,
`--host` and the metrics URLs choose where keyed traffic goes, `--k3-out` where the run is written. Locust's
web UI has no login unless `--web-login`. So a start request may carry only Locust's own swarm fields and the
options declared live (k3load.loadgen.options.LIVE_OPTIONS); a host only of the origin given at start (the key
is bound to it); a plan only by the name of one under plans/. Values are never repeated in a refusal.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from k3load.client.origin import is_loopback
from k3load.client.origin import key_origin as origin
from k3load.loadgen.options import LIVE_OPTIONS, TRANSPORTS, positive_bytes

# Locust 2.47's own swarm form fields (webui: userCount, spawnRate, runTime, profile, userClasses, shapeClass,
# sent snake_cased); `host` is checked apart
SWARM_FIELDS = frozenset({"user_count", "spawn_rate", "run_time", "profile", "user_classes", "shape_class"})
USER_SETTINGS = frozenset({"user_class_name", "tasks", "weight", "fixed_count"})
PLAN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")

WHY_FIXED = {  # the options a refusal most often meets, said in words; any other: "fixed at start"
    "k3_server_log_cmd": "it runs a command", "k3_restart_cmd": "it runs a command",
    "k3_out": "it chooses where files are written", "k3_metrics_url": "it chooses where the harness connects",
    "k3_gpu_metrics_url": "it chooses where the harness connects",
    "k3_prometheus_url": "it chooses where the harness connects", "k3_api_key": "it is a secret",
    "k3_header": "it is a secret",
}


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError("must be a number > 0")
    return value


def _transport(text: str) -> str:
    if text not in TRANSPORTS:
        raise ValueError(f"must be one of {', '.join(TRANSPORTS)}")
    return text


# how each live option's text becomes its value (what argparse would make of it at start)
LIVE_TYPES: dict[str, Callable[[str], Any]] = {
    "k3_plan": str, "k3_seed": int, "k3_model": str, "k3_transport": _transport,
    "k3_sample_interval": _positive_float, "k3_max_body_bytes": positive_bytes, "k3_max_line_bytes": positive_bytes}


def page_name(dest: str) -> str:
    """The name Locust's page gives an option in its start request: camelCased on the page and snake_cased
    back (webui's `di`/`fi`: `/_([a-z0-9])/` up, then `/([a-z0-9])([A-Z0-9])/` to `$1_$2`), which mangles a
    digit: `k3_max_body_bytes` comes back as `k_3max_body_bytes`, a name Locust's /swarm ignores."""
    camel = re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), dest)
    return camel if camel[0].isupper() else re.sub(r"([a-z0-9])([A-Z0-9])", r"\1_\2", camel).lower()


PAGE_NAMES = {page_name(dest): dest for dest in LIVE_OPTIONS if page_name(dest) != dest}


def live_settings(form: Mapping[str, Any]) -> dict[str, Any]:
    """The live options this form sets, as values, under either name (Locust applies a real name itself, with
    no check; a page name, which it ignores, is applied by k3load.loadgen.webui). ValueError names the option."""
    out = {}
    for key, text in form.items():
        dest = PAGE_NAMES.get(key, key)
        if dest in LIVE_TYPES:
            try:
                out[dest] = LIVE_TYPES[dest](str(text))
            except (ValueError, argparse.ArgumentTypeError) as exc:  # int(), float(), positive_bytes
                why = str(exc) if not isinstance(exc, ValueError) or "must" in str(exc) else "is not a number"
                raise ValueError(f"the start request's {dest} {why}") from None
    return out


def refusal(form: Mapping[str, Any], start_host: str | None, plans_dir: Path, start_plan: str = "") -> str | None:
    """Why this /swarm form is refused, or None. `form`: its field names to values (the first of each); Locust's
    page sends every live option back with its value (under its page name), the plan given at start among them."""
    fixed = sorted(name for name in form if name not in SWARM_FIELDS | LIVE_OPTIONS | PAGE_NAMES.keys() | {"host"})
    if fixed:
        name = _said(fixed[0])
        why = WHY_FIXED.get(fixed[0], "it is fixed when k3load starts")
        more = f" (and {len(fixed) - 1} more)" if len(fixed) > 1 else ""
        return f"the start request sets {name}{more}: {why}; restart k3load with the option instead"
    host = form.get("host")
    if _other_target(host, start_host):
        return (f"the start request names another target ({origin(str(host)) or 'not a URL'}) than the one given at "
                f"start ({origin(start_host) or 'none'}): the key is bound to that one; restart k3load with --host")
    try:
        plan = live_settings(form).get("k3_plan")
    except ValueError as exc:
        return str(exc)
    if plan and plan != start_plan and not (PLAN_NAME.fullmatch(str(plan)) and (plans_dir / f"{plan}.yaml").is_file()):
        return "the start request names a plan that is not one shipped under plans/ (a file is chosen at start)"
    return None


def no_workers_refusal(workers: int | None) -> str | None:
    """Why a start on a master with no worker connected is refused (None: a local runner, or workers there).
    Why: Locust's master answers such a start with success and does nothing (locust/runners.py MasterRunner.start
    only logs "You can't start a distributed test before at least one worker processes has connected"), so the
    visitor who clicks Start while --processes' workers are still importing sees a test that never begins."""
    if workers is None or workers > 0:
        return None
    return ("no worker has connected to this master yet (with --processes they connect a few seconds after start): "
            "start again once the Workers tab lists them")


def _other_target(host: Any, start_host: str | None) -> bool:
    """A host given (even empty) that is not the start one's origin: the key is bound to that one."""
    return host is not None and (not origin(str(host)) or origin(str(host)) != origin(start_host))


def _said(name: str) -> str:
    """A field name from the visitor, safe for one console line (a name may hold a newline or anything)."""
    return name if name.isidentifier() and len(name) <= 60 else repr(name[:60])


def user_settings_refusal(settings: Any, start_host: str | None) -> str | None:
    """POST /user sets any attribute of a user class (locust/env.py update_user_class): only these."""
    if not isinstance(settings, dict):
        return "the user settings are not an object"
    other = sorted(str(k) for k in settings if k not in USER_SETTINGS | {"host"})
    if other:
        return f"the user settings set {_said(other[0])}: only {', '.join(sorted(USER_SETTINGS))} may change"
    if _other_target(settings.get("host"), start_host):
        return "the user settings name another target than the one given at start: the key is bound to that one"
    return None


def exposure_warnings(parsed: Any, has_web_ui: bool, is_master: bool) -> Iterable[str]:
    """Said once at start (k3load.loadgen.listeners): a web UI or worker port reachable beyond this machine."""
    web_host = getattr(parsed, "web_host", "")
    if has_web_ui and not is_loopback(web_host) and not getattr(parsed, "web_login", False):
        yield (f"the web UI listens on {web_host or 'every interface'} without --web-login: anyone who reaches it can "
               "start and stop load against the target (never change where it goes, run a command or read the "
               "key); keep --web-host 127.0.0.1 and reach it through an SSH tunnel (docs/webui.md)")
    bind = getattr(parsed, "master_bind_host", "")
    if is_master and not is_loopback(bind):
        yield (f"the workers' port {getattr(parsed, 'master_bind_port', 5557)} listens on "
               f"{'every interface' if bind in ('', '*') else bind}: anyone who reaches it can join as a worker and "
               "read the plan and the target (never the key: workers read it from their own environment); bind it "
               "with --master-bind-host to an address only the workers reach")
