"""Nobody in through the web UI (issue 36): no command, target, path or secret from a visitor, and no secret in
any page or route. What a start request may set (only the live options, the users and rates, a shipped plan,
the target's own origin), which options reach Locust's page, when an exposed port is said, and the web UI
attacked on a real run. The worker port is test_webui_security_workers.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from k3load.evidence import lines
from k3load.loadgen import ui_guard
from k3load.loadgen.live import LINKS
from k3load.loadgen.options import LIVE_OPTIONS, SAFE_WEB_HOST, add_options
from k3load.private_files import exposed
from tests.sim.locust_runs import ROOT, _free_port
from tests.sim.ui_secrets import HEADER, KEY, TARGET, _leaks
from tests.webui_fixtures import WebUI, web_ui_fixture  # noqa: F401  (the web_ui fixture)

PLANS = ROOT / "plans"


# -- what a start request may set -------------------------------------------------------------------------
FIXED = {"k3_server_log_cmd": "bash -c 'id > /tmp/proof'", "k3_restart_cmd": "touch /tmp/proof",
         "k3_out": "/tmp/elsewhere", "k3_metrics_url": "http://10.0.0.9:9/metrics",
         "k3_gpu_metrics_url": "http://10.0.0.9:9/metrics", "k3_prometheus_url": "http://10.0.0.9:9090",
         "k3_api_key": "sk-other", "k3_header": "X-A: b", "k3_recipe": "recipes/local-dev.yaml",
         "k3_scenarios": "/etc/*", "k3_run_id": "../../escape", "k3_insecure": "true", "k3_ca_bundle": "/tmp/ca.pem",
         "k3_server_log": "/etc/shadow", "k3_startup_log": "/etc/shadow", "k3_judge": "someone",
         "k3_accept_limited": "true", "k3_reference": "/tmp", "k3_secrets_check": "pbkdf2-sha256$1$00$00",
         "html_file": "/tmp/r.html", "csv_prefix": "/tmp/x", "logfile": "/tmp/l", "json_file": "/tmp/j",
         "locustfile": "/tmp/evil.py", "web_login": "false", "master_host": "10.0.0.9"}


@pytest.mark.parametrize("name", sorted(FIXED))
def test_a_start_request_that_sets_anything_fixed_at_start_is_refused_without_its_value(name: str) -> None:
    form = {"user_count": "1", "spawn_rate": "1", "host": TARGET, name: FIXED[name]}
    why = ui_guard.refusal(form, TARGET, PLANS)
    assert why is not None and name in why and FIXED[name] not in why


def test_a_field_name_is_said_on_one_line_whatever_the_visitor_sent() -> None:
    why = ui_guard.refusal({"x\nk3load: forged line": "1"}, TARGET, PLANS) or ""
    assert "\n" not in why and "forged" in why
    assert "\n" not in (ui_guard.user_settings_refusal({"a\nb": 1}, TARGET) or "")


def test_users_rates_live_options_and_a_shipped_plan_pass_and_the_target_is_bound_to_its_origin() -> None:
    live = {"user_count": "4", "spawn_rate": "2", "run_time": "1m", "profile": "p", "shape_class": "Default",
            "user_classes": "AgentUser", "host": TARGET + "/", "k3_plan": "smoke", "k3_seed": "3",
            "k3_model": "m", "k3_transport": "httpx", "k3_sample_interval": "2", "k3_max_body_bytes": "10",
            "k3_max_line_bytes": "10"}
    assert set(live) - {"host"} <= ui_guard.SWARM_FIELDS | LIVE_OPTIONS
    assert ui_guard.refusal(live, TARGET, PLANS) is None
    assert ui_guard.refusal({"host": "HTTP://127.0.0.1:8000/v1"}, TARGET, PLANS) is None  # the same origin
    assert ui_guard.refusal({"host": "http://localhost:80"}, "http://localhost", PLANS) is None  # default port
    for other in ("http://127.0.0.1:8001", "https://127.0.0.1:8000", "http://evil.example:8000", "not a url",
                  "http://user:pw@10.1.1.1:8000"):
        why = ui_guard.refusal({"host": other}, TARGET, PLANS)
        assert why is not None and "bound" in why and "pw" not in why, other
    assert "bound" in (ui_guard.refusal({"host": TARGET}, None, PLANS) or "")  # no target given at start
    for plan in ("../plans/smoke", "/tmp/plan.yaml", "nosuchplan", "smoke.yaml"):
        assert "plan" in (ui_guard.refusal({"k3_plan": plan}, TARGET, PLANS, "/srv/mine.yaml") or ""), plan
    # the page sends the live options back as they are: the plan file given at start passes
    assert ui_guard.refusal({"k3_plan": "/srv/mine.yaml"}, TARGET, PLANS, "/srv/mine.yaml") is None


def test_the_live_options_pass_under_the_names_locusts_page_gives_them_and_are_read_as_values() -> None:
    """Locust's page camelCases option names and snake_cases them back, mangling the digit of `k3_`: its start
    request carries `k_3plan`, `k_3max_body_bytes`, ... (seen from the page in test_webui_browser)."""
    assert ui_guard.page_name("k3_max_body_bytes") == "k_3max_body_bytes"
    assert ui_guard.page_name("k3_plan") == "k_3plan" and ui_guard.page_name("user_count") == "user_count"
    assert set(ui_guard.LIVE_TYPES) == set(LIVE_OPTIONS) and set(ui_guard.PAGE_NAMES.values()) == set(LIVE_OPTIONS)
    page = {"user_count": "2", "spawn_rate": "1", "host": TARGET, "k_3plan": "smoke", "k_3seed": "7",
            "k_3model": "", "k_3transport": "httpx", "k_3sample_interval": "0.5", "k_3max_body_bytes": "100",
            "k_3max_line_bytes": "50"}
    assert ui_guard.refusal(page, TARGET, PLANS) is None
    assert ui_guard.live_settings(page) == {"k3_plan": "smoke", "k3_seed": 7, "k3_model": "", "k3_transport": "httpx",
                                            "k3_sample_interval": 0.5, "k3_max_body_bytes": 100,
                                            "k3_max_line_bytes": 50}
    for key, bad in (("k_3seed", "x"), ("k3_transport", "curl"), ("k_3max_body_bytes", "0"),
                     ("k_3sample_interval", "nan"), ("k_3plan", "/etc/passwd")):
        assert ui_guard.refusal({**page, key: bad}, TARGET, PLANS) is not None, key


def test_user_settings_change_only_tasks_weight_and_count() -> None:
    ok = {"user_class_name": "AgentUser", "tasks": ["play"], "weight": 2, "fixed_count": 0}
    assert ui_guard.user_settings_refusal(ok, TARGET) is None
    assert "target" in (ui_guard.user_settings_refusal({**ok, "host": "http://evil:1"}, TARGET) or "")
    assert "wait_time" in (ui_guard.user_settings_refusal({**ok, "wait_time": 0}, TARGET) or "")
    assert ui_guard.user_settings_refusal(["not", "an", "object"], TARGET) is not None


def test_only_the_live_options_reach_the_page_and_the_web_ui_binds_to_loopback_by_default() -> None:
    from locust.argument_parser import get_parser

    parser = get_parser()  # Locust's own, with k3load's options added as the locustfile's listener does
    add_options(parser)
    shown = {dest for dest in parser.args_included_in_web_ui if dest.startswith("k3_")}
    assert shown == set(LIVE_OPTIONS)
    assert not {"k3_api_key", "k3_header"} & set(parser.secret_args_included_in_web_ui)
    assert parser.parse_args([]).web_host == SAFE_WEB_HOST == "127.0.0.1"
    assert parser.parse_args(["--web-host", "0.0.0.0"]).web_host == "0.0.0.0"


def test_exposure_is_said_for_a_web_ui_or_worker_port_beyond_loopback_only() -> None:
    def said(**opts: Any) -> list[str]:
        parsed = SimpleNamespace(**{"web_host": "127.0.0.1", "web_login": False, "master_bind_host": "127.0.0.1",
                                    "master_bind_port": 5557, **opts})
        return list(ui_guard.exposure_warnings(parsed, True, True))

    assert said() == [] and said(web_host="::1", master_bind_host="localhost") == []
    assert said(web_host="0.0.0.0", web_login=True) == []
    (web,) = said(web_host="0.0.0.0")
    assert "without --web-login" in web and "SSH tunnel" in web
    assert len(said(web_host="", master_bind_host="*")) == 2 and len(said(web_host="10.0.0.5")) == 1


# -- the web UI, attacked ------------------------------------------------------------------------------------
LOCUST_GET_ROUTES = ("/", "/stats/requests", "/stats/report", "/stats/requests/csv",
                     "/stats/requests_full_history/csv", "/stats/failures/csv", "/exceptions", "/exceptions/csv",
                     "/tasks", "/logs", "/worker-count")
K3_GET_ROUTES = ("/k3load/state", "/k3load/", "/k3load/tab.js", *(f"/k3load/run/{name}" for name in LINKS))


def test_the_route_list_covers_every_get_route_locust_serves() -> None:
    from locust.env import Environment
    from locust.web import WebUI as LocustWebUI

    app = LocustWebUI(Environment(), "127.0.0.1", 0).app
    served = {rule.rule for rule in app.url_map.iter_rules() if "GET" in (rule.methods or ())
              and "<" not in rule.rule and rule.rule not in ("/login", "/static/")}
    assert served <= set(LOCUST_GET_ROUTES), served - set(LOCUST_GET_ROUTES)


def _all_routes(ui: WebUI) -> dict[str, str]:
    pages = {}
    for route in (*LOCUST_GET_ROUTES, *K3_GET_ROUTES):
        answer = ui.http.get(ui.base + route)
        pages[route] = answer.content.decode("latin-1")
        if route.endswith(".gz") and answer.status_code == 200:
            import gzip

            pages[route] += gzip.decompress(answer.content).decode("utf-8", "replace")
    return pages


@pytest.mark.slow
def test_the_web_ui_runs_no_ones_command_sends_the_key_nowhere_else_and_shows_no_secret(web_ui, tmp_path):
    marker = tmp_path / "proof"
    elsewhere = tmp_path / "elsewhere"
    ui, sim = web_ui("--k3-api-key", KEY, "--k3-header", HEADER)
    assert KEY not in ui.http.get(ui.base + "/").text and "k3_api_key" not in ui.http.get(ui.base + "/").text
    command = f"bash -c 'id > {marker}'"
    attacks = {"k3_server_log_cmd": command, "k3_restart_cmd": command, "k3_out": str(elsewhere),
               "html_file": str(elsewhere / "r.html"), "k3_metrics_url": f"http://127.0.0.1:{_free_port()}/metrics"}
    for name, value in attacks.items():
        answer = ui.http.post(ui.base + "/swarm", data={"user_count": 1, "spawn_rate": 1, "host": sim.base_url,
                                                         name: value}).json()
        assert answer["success"] is False and name in answer["message"] and value not in answer["message"], answer
    other = f"http://127.0.0.1:{_free_port()}"
    answer = ui.http.post(ui.base + "/swarm", data={"user_count": 1, "spawn_rate": 1, "host": other}).json()
    assert answer["success"] is False and "bound" in answer["message"]
    user = ui.http.post(ui.base + "/user", json={"user_class_name": "AgentUser", "host": other})
    assert user.status_code == 403
    assert ui.state()["run_id"] is None  # nothing started
    ui.swarm(1, sim.base_url)  # the same origin: a run starts
    ui.wait_for(lambda s: (s.get("signals") or {}).get("attempts", 0) >= 2, 60, "two attempts")
    ui.http.post(ui.base + "/stop")
    ui.wait_for(lambda s: s.get("verdict") is not None, 120, "the verdict")
    pages = _all_routes(ui)
    assert not _leaks(pages)
    assert not marker.exists() and not elsewhere.exists()
    run_files = {str(p): "".join(lines(p, errors="replace")) for p in ui.out.rglob("*") if p.is_file()}
    assert run_files and not _leaks(run_files)
    assert exposed(ui.out) == []  # every file 0600, every folder 0700 (k3load.private_files)
    log = (tmp_path / "locust.log").read_text()
    assert log.count("k3load: web UI: refused") == len(attacks) + 2 and not _leaks({"log": log})
