"""The compat rules about the server itself: the API answers, /metrics can be read, it is not the sim.

Why /metrics has a rule of its own: an engine behind a gateway that forwards only /v1 is a working API
whose monitoring is out of reach there — an observability gap (`inconclusive`, with the reason), never a
broken deployment (`fail`, which would send it back to `rebuild`).
"""

from __future__ import annotations

from typing import Any

from k3load.outcomes import FAIL, INCONCLUSIVE, PASS
from k3load.precheck.evidence import Evidence
from k3load.precheck.recipe import Recipe
from k3load.precheck.rule_base import files_of, result


def server_reachable(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """The API answered the read-only endpoints it serves (/version, /v1/models). Why not /metrics: an engine
    behind a gateway that forwards only /v1 is still a working API; /metrics is judged by metrics_reachable."""
    if ev.server is None:
        return result("server_reachable", INCONCLUSIVE, "no --base-url: /version, /v1/models, /metrics not read")
    files = files_of(ev, "server_fetch", "server_version", "server_models")
    endpoints = ev.server["endpoints"]
    bad = [f"{e['path']}: {e['error'] or 'HTTP ' + str(e['status'])}"
           for e in (endpoints.get(n, {"path": n, "error": "not fetched"}) for n in ("version", "models"))
           if e.get("error") or e.get("status") != 200]
    if bad:
        return result("server_reachable", FAIL, f"{ev.server['base_url']} did not answer: {'; '.join(bad)}", files)
    models = ", ".join(f"{m.get('id')} (max_model_len {m.get('max_model_len')})" for m in ev.server["models"])
    gap = metrics_gap(ev)
    return result("server_reachable", PASS, f"{ev.server['base_url']} answered /version "
                  f"({ev.server['version']}), /v1/models ({models or 'none'})"
                  + (f"; {gap}" if gap else f", /metrics ({ev.server['vllm_series']} vllm:* families)"), files)


def metrics_gap(ev: Evidence) -> str | None:
    """Why /metrics could not be read ("/metrics answered 404 at URL"), None when it was."""
    if ev.server is None:
        return "no --base-url: /metrics not read"
    endpoint = ev.server["endpoints"].get("metrics") or {"path": "/metrics", "error": "not fetched"}
    where = endpoint.get("url") or f"{ev.server['base_url']}{endpoint.get('path', '/metrics')}"
    if endpoint.get("error"):
        return f"/metrics did not answer at {where} ({endpoint['error']})"
    if endpoint.get("status") != 200:
        return f"/metrics answered {endpoint.get('status')} at {where}"
    if not ev.server["metrics_read"]:
        return f"/metrics at {where} was not in the Prometheus text format"
    if ev.server.get("engine_gauges_absent"):
        return (f"/metrics at {where} has no engine gauges ({', '.join(ev.server['engine_gauges_absent'])}; "
                f"only {ev.server['vllm_series']} vllm:* families: is --disable-log-stats set?)")
    return None


def metrics_reachable(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """The engine's /metrics can be read: without it the run has no server view (queues, KV cache, prefix-cache
    counters). An observability gap, never a broken deployment: inconclusive, not fail."""
    gap = metrics_gap(ev)
    files = files_of(ev, "server_fetch", "server_metrics")
    if gap is None and ev.server is not None:
        endpoint = ev.server["endpoints"].get("metrics") or {}
        where = endpoint.get("url") or f"{ev.server['base_url']}/metrics"
        return result("metrics_reachable", PASS, f"{where} answered ({ev.server['vllm_series']} vllm:* families)",
                      files)
    return result("metrics_reachable", INCONCLUSIVE, f"inconclusive, because {gap}: monitoring is not possible "
                  "there (no queue, KV-cache or prefix-cache view); give --k3-metrics-url or --k3-prometheus-url "
                  "where the engines' metrics are", files)


def target_not_sim(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """The k3load sim marks itself; under a production recipe it is never evidence."""
    if ev.server is None:
        return result("target_not_sim", INCONCLUSIVE, "no server checked: cannot tell whether it is the k3load sim")
    files = files_of(ev, "server_metrics", "server_probe_chat")
    marker = ev.server["sim_marker"]
    if marker and recipe.section("target")["allow_sim"]:
        return result("target_not_sim", PASS, f"target is the k3load sim ({marker}): accepted by the "
                      f"{recipe.name} recipe for rehearsal; the sim is never evidence for production", files)
    if marker:
        return result("target_not_sim", FAIL, f"target is the k3load sim ({marker}): the sim is never evidence",
                      files)
    if not (ev.server["metrics_read"] or "server_probe_chat" in ev.files):
        return result("target_not_sim", INCONCLUSIVE, "neither /metrics nor a probe answer could be read", files)
    return result("target_not_sim", PASS, "not the k3load sim: no k3load_sim_info on /metrics, no k3loadsim "
                  "fingerprint", files)
