"""The echoing server of the secrets tests, and what they share: a real HTTP server on loopback (plain, or TLS
with a context given) that repeats the Authorization and X-Gateway-Token headers in every body it sends (401
pages, /version, /tokenize, /metrics labels, chat answers and chat error bodies), the secrets it is sent, a
scan of a run directory and console for them in any form, and the `k3load` subcommands run with the key.
Used by test_secrets.py, test_secrets_tls.py and test_reliability_matrix.py; no tests here."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from k3load.evidence import lines
from tests.secret_scan import encodings, leaks

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "recipes" / "local-dev.yaml"
KEY = "sk-k3-SECRET-4f9a2c"
GATEWAY = "gw-SECRET-77d1"
GATEWAY_HEADER = f"X-Gateway-Token: {GATEWAY}"
SECRETS = (KEY, GATEWAY)


# -- the echo server --------------------------------------------------------------------------------
class EchoHandler(BaseHTTPRequestHandler):
    """Every body repeats the request's secrets; the API refuses a request without the key (401)."""

    protocol_version = "HTTP/1.1"
    server: EchoServer

    def log_message(self, *args: Any) -> None:  # quiet: the test asserts on the console of the run only
        pass

    def _echo(self) -> str:
        """The secrets as received, and each in every form a server may echo it (JSON escapes, percent,
        base64 of user:key; tests/secret_scan.py's `encodings`)."""
        auth, gateway = self.headers.get("Authorization"), self.headers.get("X-Gateway-Token")
        forms = [form for value in ((auth or "").removeprefix("Bearer "), gateway or "") if value
                 for form in encodings(value).values()]
        return f"Authorization={auth!r} X-Gateway-Token={gateway!r} forms={' '.join(forms)}"

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _keyed(self) -> bool:
        path = self.path.split("?")[0]
        self.server.seen.append((self.command, path, self.headers.get("Authorization"),
                                 self.headers.get("X-Gateway-Token")))
        if self.headers.get("Authorization") == f"Bearer {KEY}":
            return True
        self._send(401, json.dumps({"error": {"message": f"bad key: {self._echo()}", "code": 401}}).encode())
        return False

    def do_GET(self) -> None:
        if not self._keyed():
            return
        path = self.path.split("?")[0]
        if path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "echo", "object": "model",
                                        "max_model_len": 4096, "owned_by": self._echo()}]}).encode())
        elif path == "/version":  # the key also hidden behind JSON escapes: \u0073k-...
            hidden = "".join(f"\\u{ord(c):04x}" for c in KEY)
            self._send(200, b'{"version": "0.32.0", "echo": ' + json.dumps(self._echo()).encode()
                       + b', "escaped": "' + hidden.encode() + b'"}')
        elif path == "/health":
            self._send(200, f"ok {self._echo()}".encode(), "text/plain")
        elif path == "/metrics":
            label = f"{self.headers.get('Authorization')} {self.headers.get('X-Gateway-Token')}"
            text = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
                    f"# TYPE echo_info gauge\necho_info{{echo=\"{label}\"}} 1\n")
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, f"no {path}: {self._echo()}".encode(), "text/plain")

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not self._keyed():
            return
        if self.path == "/tokenize":
            self._send(200, json.dumps({"count": len(request.get("prompt", "")) // 4 + 1, "echo": self._echo()})
                       .encode())
            return
        self.server.chats += 1
        if self.server.chats % 3 == 0:
            self._send(500, json.dumps({"error": {"message": f"upstream: {self._echo()}", "type": "Internal",
                                                  "code": 500}}).encode())
        elif request.get("stream"):
            self._send(200, _sse(f"echo {self._echo()}"), "text/event-stream")
        else:
            self._send(200, json.dumps(_completion(f"echo {self._echo()}")).encode())


def _completion(text: str) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion", "model": "echo", "created": 0,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


def _sse(text: str) -> bytes:
    base = {"id": "c1", "object": "chat.completion.chunk", "model": "echo", "created": 0}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {**base, "choices": [{"index": 0, "delta": {"content": text}}]},
              {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {**base, "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}]
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


class EchoServer(ThreadingHTTPServer):
    """On a free loopback port; with `tls`, each connection's handshake runs in its own handler thread."""

    daemon_threads = True

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), EchoHandler)
        self.tls, self.seen, self.chats = tls, [], 0
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is not None:
            request = self.tls.wrap_socket(request, server_side=True)
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that refuses our certificate hangs up mid-handshake: expected here

    def paths_with(self, header: int, value: str) -> set[str]:
        """Paths requested with this header value (2: Authorization, 3: X-Gateway-Token)."""
        return {s[1] for s in self.seen if s[header] == value}


def _leaks(run_dir: Path, *texts: str) -> list[str]:
    """Where a secret can be read back, in any form (tests/secret_scan.py): files under the run directory
    (any bytes, compressed ones inflated), and the given console texts."""
    found = [f"{p.relative_to(run_dir)}: {s}" for p in sorted(run_dir.rglob("*")) if p.is_file()
             for s in SECRETS if leaks("".join(lines(p, errors="replace")), s)]
    return found + [f"console: {s}" for text in texts for s in SECRETS if leaks(text, s)]


def _k3load(*args: str, timeout_s: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "K3_API_KEY": KEY, **(env or {})}
    return subprocess.run([sys.executable, "-m", "k3load", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
