"""The secrets of the web UI and worker-port tests (test_webui_security.py, test_webui_security_workers.py):
a key and a gateway header value given at start, the target the run is bound to, and where either secret
shows up in given texts. No tests here."""

from __future__ import annotations

KEY = "sk-k3-UI-SECRET-93be1"
GATEWAY = "gw-UI-SECRET-5c0d"
HEADER = f"X-Gateway-Token: {GATEWAY}"
SECRETS = (KEY, GATEWAY)
TARGET = "http://127.0.0.1:8000"


def _leaks(texts: dict[str, str]) -> list[str]:
    return [f"{where}: {secret}" for where, text in texts.items() for secret in SECRETS if secret in text]
