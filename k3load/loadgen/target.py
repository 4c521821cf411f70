"""The target's own API outside chat (/v1/models, /tokenize, /health) with the run's key, headers and TLS.

Why apart from the session: the run's start (which model, how long a context), the restart drill's probe, the
replay's and long inputs' token counts all read the target this way; each is handed a `TargetApi` (the host and
options as they are now: the web UI may change both between tests) instead of the whole session.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from k3load.client.access import gevent_patched, tls_hint
from k3load.client.origin import redirect_note
from k3load.errors import InputError
from k3load.loadgen.options import run_access


class TargetUnusable(InputError):
    """The target at --host cannot be used (it does not answer, refuses the key, redirects, or changed since
    start): the user's --host, key or server, said in one line; never a bug of the harness."""


@dataclass(frozen=True)
class TargetApi:
    """`host` (Locust's --host, as now) and the parsed options the run's access is read from."""

    host: str
    options: Any

    def url(self, path: str) -> str:
        return f"{self.host.rstrip('/')}{path}"

    def client(self) -> httpx.Client:
        """The key, the gateway headers and the run's TLS trust, like every chat request."""
        secrets, tls = run_access(self.options)
        return httpx.Client(headers=secrets.request_headers(), verify=tls.context(gevent_patched()), timeout=30)

    def discover(self, wanted: str | None) -> tuple[str, int | None]:
        """The model to send (`wanted`, else the first the server lists) and its max_model_len (None: unsaid).
        Raises TargetUnusable when /v1/models does not answer as an OpenAI server does."""
        url = self.url("/v1/models")
        try:
            with self.client() as client:
                resp = client.get(url)
        except (httpx.HTTPError, httpx.InvalidURL, KeyError, ValueError, TypeError) as exc:
            raise self._no_answer(exc) from None
        if note := redirect_note(resp.status_code, resp.headers.get("location"), url):  # never followed
            raise TargetUnusable(f"the server at {self.host} answered /v1/models with HTTP {resp.status_code}: "
                                 f"{note} (the key goes only to --host's origin: give the URL it redirects to)")
        if resp.status_code in (401, 403):
            raise TargetUnusable(f"the server at {self.host} refused /v1/models (HTTP {resp.status_code}): "
                                 "is --k3-api-key (K3_API_KEY) or --k3-header right?")
        try:  # an OpenAI model list: {"data": [{"id": ..., "max_model_len": ...}, ...]}, or not the server we want
            cards = resp.json()["data"]
            card = next((c for c in cards if c["id"] == wanted), cards[0]) if cards else {}
            model = wanted or card.get("id", "")
        except (KeyError, ValueError, TypeError, AttributeError, IndexError) as exc:
            kind = resp.headers.get("content-type", "no content type").split(";")[0]
            raise TargetUnusable(f"the server at {self.host} answered /v1/models with HTTP {resp.status_code} "
                                 f"({kind}), not an OpenAI model list ({type(exc).__name__}): is --host the vLLM "
                                 "server, or its gateway's route to it?") from None
        if not model:  # every request would name no model: vLLM's 404 on each, never a finding about the server
            raise TargetUnusable(f"the server at {self.host} lists no model on /v1/models: give the model to "
                                 "send with --k3-model")
        return model, card.get("max_model_len")

    def _no_answer(self, exc: Exception) -> TargetUnusable:
        """Nothing an OpenAI server would say: a refused connection, a TLS failure (with its hint), no JSON."""
        hint = tls_hint(str(exc))
        return TargetUnusable(f"the server at {self.host} does not answer /v1/models ({type(exc).__name__})"
                              + (hint or ": is it running, and is --host right?"))

    def token_counter(self, model: str, fallback: Callable[[str], int]) -> Callable[[str], int]:
        """The server's own count of a text's tokens (/tokenize), `fallback`'s where it cannot say."""
        def count(text: str) -> int:
            try:
                with self.client() as client:
                    resp = client.post(self.url("/tokenize"), json={"model": model, "prompt": text})
                return int(resp.json()["count"])
            except (httpx.HTTPError, KeyError, ValueError, TypeError):
                return fallback(text)

        return count

    def answers(self, timeout_s: float) -> bool:
        """/health and /v1/models both answer 200 (vLLM serves /v1/models only once the engine is up)."""
        try:
            with self.client() as client:
                return all(client.get(self.url(path), timeout=timeout_s).status_code == 200
                           for path in ("/health", "/v1/models"))
        except httpx.HTTPError:
            return False
