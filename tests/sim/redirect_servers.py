"""The two loopback servers of the redirect tests, shared by their files: A (`servers`) answers by a route, mostly
a redirect to B (`b`), which records the headers of every request it gets and answers as each endpoint would;
the key and the gateway header they look for."""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from k3load.client.access import Secrets

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-k3-REDIRECT-9b1e"
GATEWAY = "gw-REDIRECT-5c3a"
SECRETS = Secrets.parse(KEY, [f"X-Gateway-Token: {GATEWAY}"])
METRICS = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
           "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
           "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0\n")
DCGM = '# TYPE DCGM_FI_DEV_FB_USED gauge\nDCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",Hostname="n1"} 1000\n'
MATRIX = json.dumps({"status": "success", "data": {"resultType": "matrix", "result": []}})
Route = Callable[[str, str], tuple[int, dict[str, str], bytes]]  # (method, path) -> (status, headers, body)
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})


# -- the servers ----------------------------------------------------------------------------------------
class Handler(BaseHTTPRequestHandler):
    """Records every request; answers by the server's `route(method, path) -> (status, headers, body)`."""

    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.seen.append((self.command, self.path, dict(self.headers.items())))
        status, headers, body = self.server.route(self.command, self.path)
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer


class Server(ThreadingHTTPServer):
    """On a free loopback port, in a thread (a greenlet under the tests' gevent patch)."""

    daemon_threads = True
    seen: list[tuple[str, str, dict[str, str]]]  # (method, path, headers) of every request, in order

    def __init__(self, route: Route, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.route, self.tls, self.seen = route, tls, []
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, args=(0.02,), daemon=True).start()

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is not None:
            request = self.tls.wrap_socket(request, server_side=True)
        super().finish_request(request, client_address)

    def credentials_seen(self) -> list[str]:
        """Every request that carried the key or the gateway value in any header, as 'METHOD PATH'."""
        return [f"{method} {path}" for method, path, headers in self.seen
                if any(KEY in v or GATEWAY in v for v in headers.values())
                or any(name.lower() in ("authorization", "x-gateway-token") for name in headers)]

    def paths(self) -> list[str]:
        return [path.split("?", 1)[0] for _method, path, _headers in self.seen]

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def _recorder(method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """B: what each endpoint would answer, so a followed redirect reads as a success."""
    path = path.split("?", 1)[0]
    if path.startswith("/api/v1/query_range"):
        return 200, {"Content-Type": "application/json"}, MATRIX.encode()
    if path.startswith("/dcgm"):
        return 200, {"Content-Type": "text/plain"}, DCGM.encode()
    if method == "POST":
        return 200, {"Content-Type": "application/json"}, b'{"tokens": [1, 2]}'
    return 200, {"Content-Type": "text/plain"}, (METRICS if path.endswith("metrics") else "ok").encode()


def _redirector(to: str, status: int = 302) -> Route:
    """A: every request sent on to `to` + its path and query."""
    return lambda _method, path: (status, {"Location": to + path}, b"moved")


@pytest.fixture
def b() -> Iterator[Server]:
    server = Server(_recorder)
    yield server
    server.close()


@pytest.fixture
def servers() -> Iterator[Callable[..., Server]]:
    made: list[Server] = []

    def make(route: Route, tls: ssl.SSLContext | None = None) -> Server:
        made.append(Server(route, tls))
        return made[-1]

    yield make
    for server in made:
        server.close()
