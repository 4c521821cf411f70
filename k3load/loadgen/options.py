"""k3load's Locust options (also settable in `[tool.locust]`, a locust.conf or `LOCUST_*`/K3_* env)."""

from __future__ import annotations

from typing import Any

TRANSPORTS = ("geventhttpclient", "httpx")


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
    group.add_argument("--k3-model", default="", env_var="K3_MODEL",
                       help="served model name (default: the first of the server's /v1/models)")
    group.add_argument("--k3-transport", default="geventhttpclient", choices=TRANSPORTS, env_var="K3_TRANSPORT",
                       help="streaming transport (geventhttpclient times first tokens more tightly)")
    group.add_argument("--k3-run-id", default="", env_var="K3_RUN_ID", include_in_web_ui=False,
                       help="run id (default: generated); salts per-run prefixes")


SECRET_OPTIONS = ("k3_api_key",)


def public_options(parsed: Any) -> dict[str, Any]:
    """Every option of the run with secrets replaced, for run.json."""
    out = {}
    for key, value in sorted(vars(parsed).items()):
        secret = key in SECRET_OPTIONS or any(word in key.lower() for word in ("key", "token", "password"))
        if secret:
            out[key] = "***" if value else ""
        elif _plain(value):
            out[key] = value
    return out


def _plain(value: Any) -> bool:
    if isinstance(value, list):
        return all(isinstance(v, (str, int, float)) for v in value)
    return isinstance(value, (str, int, float, bool, type(None)))
