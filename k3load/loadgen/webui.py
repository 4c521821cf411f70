"""The k3load tab in Locust's web UI, its live page and `GET /k3load/state`.

    register(environment)     from `init`, on the master or local runner when there is a web UI
      tab "k3load"            Locust 2.47's own extension points: `template_args["extended_tabs"]` and
                              `["extended_tables"]` declare a tab holding a table, and an `after_request`
                              hook adds its rows (`extended_stats`) to each `/stats/requests` answer, which
                              the UI polls every 2 s: the run, stage and time left, the server's and GPUs'
                              signals, provisional pillars, the verdict once judged
      GET /k3load/state       the same as JSON (k3load.loadgen.live: run_id, run_dir, stage, signals,
                              pillars, verdict, history)
      GET /k3load/            the live page: the same values, charts of KV usage, waiting and GPU memory
                              with the user count, the verdict with links to the run's files (Locust's
                              extended tabs render plain-text tables only: no charts, no links)
      GET /k3load/tab.js      added to Locust's index page (an `after_request` hook): while the k3load tab
                              is open, the live page in an iframe under its table (charts and links)
      GET /k3load/run/NAME    the current run's report.html, report.md, verdict.json, records.jsonl.gz,
                              alerts.yaml, dashboard.json, validation_summary.json
      "Download Data" tab     links to the live page and the run's report (`extended_csv_files`)
      POST /swarm             while a run without a plan shape is running: a new stage `manual-N`; a start
                              request that sets anything fixed at start (a command, a URL, a path, a secret,
                              Locust's own outputs) or another target's origin is refused (k3load.loadgen.ui_guard),
                              and so is a start on a master no worker has joined yet (Locust's does nothing)
      POST /user              the class picker's settings: only tasks, weight and fixed count
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from flask import Response, abort, jsonify, request, send_file
from locust.runners import STATE_RUNNING, STATE_SPAWNING

from k3load.loadgen import held_secrets, ui_guard
from k3load.loadgen.live import LINKS, LiveState
from k3load.loadgen.webui_page import PAGE, TAB_JS
from k3load.loadgen.worker_count import WorkerCount

TAB = "k3load"
PLANS_DIR = Path(__file__).resolve().parents[2] / "plans"
log = logging.getLogger("k3load")


def register(environment: Any, live: LiveState | None = None) -> LiveState:
    web_ui, session = environment.web_ui, environment.k3_session
    _fonts_listed()
    live = live or LiveState(session)
    web_ui.template_args["extended_tabs"] = [{"title": "k3load", "key": TAB}]
    web_ui.template_args["extended_tables"] = [{"key": TAB, "structure": [{"key": "signal", "title": "k3load"},
                                                                          {"key": "value", "title": "now"}]}]
    web_ui.template_args["extended_csv_files"] = [
        {"href": "./k3load/", "title": "k3load live page (charts, verdict, report links)"},
        {"href": "./k3load/state", "title": "k3load state (JSON)"},
        {"href": "./k3load/run/report.html", "title": "k3load report of the last judged run"}]
    app, auth = web_ui.app, web_ui.auth_required_if_enabled
    start_plan = getattr(environment.parsed_options, "k3_plan", "") or ""  # a file given at start stays allowed

    @app.route("/k3load/state")
    @auth
    def k3load_state() -> Response:
        return Response(json.dumps(live.state(), default=str), mimetype="application/json")

    @app.route("/k3load/")
    @app.route("/k3load")
    @auth
    def k3load_page() -> Response:
        return Response(PAGE, mimetype="text/html")

    @app.route("/k3load/tab.js")
    @auth
    def k3load_tab_js() -> Response:
        return Response(TAB_JS, mimetype="text/javascript")

    @app.route("/k3load/run/<name>")
    @auth
    def k3load_run_file(name: str) -> Response:
        if name not in LINKS or session.run_dir is None or not (session.run_dir / name).is_file():
            abort(404)
        # a .gz sent as itself (application/gzip): by its guessed encoding Flask would add Content-Encoding:
        # gzip, and a browser would save the unpacked lines under the .gz name
        return send_file(session.run_dir / name, max_age=0,
                         mimetype="application/gzip" if name.endswith(".gz") else None)

    @app.before_request
    def k3load_guard() -> Response | tuple[Response, int] | None:
        """First of all hooks: a start request or user settings that would change what is fixed at start."""
        if request.method != "POST" or request.path not in ("/swarm", "/user"):
            return None
        bound = held_secrets.held(environment.parsed_options).origin or environment.host
        if request.path == "/swarm":
            why = (ui_guard.refusal(request.form, bound, PLANS_DIR, start_plan)
                   or ui_guard.no_workers_refusal(WorkerCount.now(environment.runner)))
        else:
            why = ui_guard.user_settings_refusal(request.get_json(force=True, silent=True), bound)
        if why is None:
            if request.path == "/swarm":  # the page's names for the live options, which Locust ignores
                for dest, value in ui_guard.live_settings(request.form).items():
                    setattr(environment.parsed_options, dest, value)
            return None
        log.error("k3load: web UI: refused a request from %s: %s", request.remote_addr, why)
        if request.path == "/user":
            return jsonify({"success": False, "message": why}), 403
        return jsonify({"success": False, "message": f"k3load refused: {why}", "host": environment.host})

    @app.before_request
    def k3load_manual_stage() -> None:
        if request.path != "/swarm" or request.method != "POST" or not session.manual.active:
            return
        if environment.runner.state not in (STATE_RUNNING, STATE_SPAWNING):
            return  # a new test: test_start opens its run and its first stage
        try:
            users, rate = int(request.form["user_count"]), float(request.form.get("spawn_rate") or 1)
        except (KeyError, ValueError):
            return  # Locust answers the bad form itself
        session.enter_manual_stage(users, rate)

    @app.after_request
    def k3load_tab_rows(response: Response) -> Response:
        if request.path == "/" and response.status_code == 200 and response.mimetype == "text/html":
            html = response.get_data(as_text=True)  # the tab's charts: the live page under the table
            response.set_data(html.replace("</body>", '<script src="./k3load/tab.js"></script></body>', 1))
            return response
        if request.path != "/stats/requests" or response.status_code != 200 or not response.is_json:
            return response
        body = response.get_json()
        body["extended_stats"] = [{"key": TAB, "data": tab_rows(live.state())}]
        response.set_data(json.dumps(body))
        return response

    return live


def _fonts_listed() -> None:
    """matplotlib lists the machine's fonts at its first import (`fc-list` in a subprocess) and caches them. Under
    gevent a subprocess starts only from the main thread's loop, and the web UI judges each run (its plots
    included) in a native thread: on a machine without the cache the first judgment died there. So the list is
    made now, in the main thread."""
    import matplotlib.font_manager  # noqa: F401


def _num(value: Any, digits: int = 1, unit: str = "") -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}{unit}"


def tab_rows(state: dict[str, Any]) -> list[dict[str, str]]:
    """The tab's table: one row per value, as text (the UI renders cells as text)."""
    sig, stage = state.get("signals") or {}, state.get("stage")
    rows = [("run", f"{state.get('run_id') or '–'}  ({state.get('run_dir') or 'no run yet'})"),
            ("stage", "–" if not stage else f"{stage['name']} ({stage['kind']}, {stage['users']} users), "
             + ("set by hand" if stage["left_s"] is None else f"{stage['left_s']:.0f} s left")),
            ("stage goodput", "–" if not stage else _goodput(stage.get("goodput"), stage.get("goodput_ci95"),
                                                              stage.get("goodput_requests"))),
            ("users", str(sig.get("users", 0))), ("requests/s", _num(sig.get("requests_per_s"), 2))]
    rows += _search_rows(state.get("search"))
    for what in ("ttft", "itl", "e2e"):
        rows.append((f"{what} p50 / p95 (stage)", f"{_num(sig.get(f'{what}_p50_ms'), 0)} / "
                     f"{_num(sig.get(f'{what}_p95_ms'), 0)} ms"))
    kv = sig.get("kv_usage")
    ratio = sig.get("prefix_cache_hit_ratio")
    rows += [("KV cache usage", "–" if kv is None else f"{kv * 100:.1f}%"),
             ("running / waiting", f"{_num(sig.get('running'), 0)} / {_num(sig.get('waiting'), 0)}"),
             ("preemptions (this run)", _num(sig.get("preemptions"), 0)),
             ("prefix cache hit ratio (this run)", "–" if ratio is None else f"{ratio * 100:.1f}%")]
    for gpu in sig.get("gpus") or []:
        rows.append((f"GPU memory {gpu['node']} #{gpu['gpu']}" + (" (simulated)" if gpu.get("simulated") else ""),
                     f"{_num(gpu.get('memory_used_mib'), 0)} / {_num(gpu.get('memory_total_mib'), 0)} MiB"))
    for worker, cpu in (sig.get("load_generator_cpu_pct") or {}).items():
        rows.append((f"load generator CPU {worker}", _num(cpu, 0, "%")))
    failed = sig.get("failed_by_layer") or {}
    rows.append(("attempts (valid)", f"{sig.get('attempts', 0)} ({sig.get('valid', 0)})"))
    rows.append(("failures by layer", ", ".join(f"{k} {v}" for k, v in sorted(failed.items())) or "none"))
    for name, pillar in (state.get("pillars") or {}).items():
        rows.append((f"{name} so far", f"{pillar['status']}: {pillar['reason']}".rstrip(": ")))
    verdict = state.get("verdict")
    if state.get("error"):
        rows.append(("harness error", f"{state['error']} (no verdict; restart Locust once it is fixed)"))
    if verdict:
        rows.append(("verdict", f"{verdict['verdict']}: " + "; ".join(verdict["because"])))
        rows.append(("report", "open the live page /k3load/ or /k3load/run/report.html"))
    else:
        rows.append(("verdict", "judged when the test stops: shown below (Locust stops refreshing this table then)"))
    return [{"signal": k, "value": v} for k, v in rows]


def _goodput(share: float | None, ci95: list[float] | None, requests: int | None) -> str:
    if not requests or share is None or not ci95:
        return "–"
    return f"{share * 100:.1f}% (95% CI {ci95[0] * 100:.1f}–{ci95[1] * 100:.1f}%) of {requests} requests"


def _search_rows(search: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The capacity search's lines (k3load.loadgen.search_live.LiveSearch.snapshot): the step, its evidence so
    far, the bracket."""
    if not search:
        return []
    queue = search.get("queue_share")
    last = search.get("last_decision")
    step = ("–" if not search.get("step") else f"{search['step']} ({search['users']} users, "
            f"{search['elapsed_s']:.0f} s" + (", a repeat near the bound" if search.get("repeat") else "") + ")")
    return [("search", search["stage"] + (f" (ended: {search['ended']})" if search.get("ended") else "")),
            ("search step", step),
            ("search step goodput", _goodput(search.get("goodput"), search.get("goodput_ci95"), search.get("requests"))
             + f" against {search['min_goodput'] * 100:.1f}%"),
            ("search step queue behind a full batch", "–" if queue is None else f"{queue * 100:.0f}% of scrapes"),
            ("search bracket (held / failed)", f"{search.get('last_good') or '–'} / {search.get('first_bad') or '–'} "
             "users"),
            ("search last decision", "–" if not last else f"{last['users']} users: {last['decision']}")]
