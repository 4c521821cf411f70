"""What `/v1/models` can answer that is not an OpenAI model list, and how the run's start says it (one line, an
InputError, exit 2): a gateway's HTML page, JSON of another shape, a list with no model in it. A real loopback
HTTP server answers with each body; `TargetApi.discover` is what a run's start calls.

Why: before, any of these was "does not answer /v1/models: is it running?" (it did answer), or, for an empty list,
a run that sent every request for the model "" and judged vLLM's 404s.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from k3load.loadgen.target import TargetApi, TargetUnusable

OPTIONS = SimpleNamespace(k3_api_key="", k3_header=[], k3_ca_bundle="", k3_insecure=False, k3_session_header="")


class _Models(BaseHTTPRequestHandler):
    body: tuple[int, str, bytes] = (200, "application/json", b"{}")

    def do_GET(self) -> None:
        status, kind, body = type(self).body
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _discover(server: ThreadingHTTPServer, answer: tuple[int, str, bytes], wanted: str | None
              ) -> tuple[str, int | None]:
    _Models.body = answer
    return TargetApi(f"http://127.0.0.1:{server.server_port}", OPTIONS).discover(wanted)


@pytest.mark.parametrize(("answer", "said"), [
    ((200, "text/html", b"<html><body>502 Bad Gateway</body></html>"),
     "HTTP 200 (text/html), not an OpenAI model list"),
    ((502, "text/html", b"<html>Bad Gateway</html>"), "HTTP 502 (text/html), not an OpenAI model list"),
    ((200, "application/json", b'{"data": "m"}'), "HTTP 200 (application/json), not an OpenAI model list (TypeError)"),
    ((200, "application/json", b"[]"), "not an OpenAI model list (TypeError)"),
    ((200, "application/json", b'{"data": [{"name": "m"}]}'), "not an OpenAI model list (KeyError)"),
    ((200, "application/json", b'{"data": []}'),
     "lists no model on /v1/models: give the model to send with --k3-model"),
    ((200, "application/json", b'{"data": null}'), "lists no model on /v1/models"),
])
def test_an_answer_that_is_not_a_model_list_is_said_as_such(server: ThreadingHTTPServer,
                                                             answer: tuple[int, str, bytes], said: str) -> None:
    with pytest.raises(TargetUnusable) as refused:
        _discover(server, answer, None)
    assert said in str(refused.value) and "does not answer" not in str(refused.value)


def test_a_model_list_gives_the_model_and_its_context(server: ThreadingHTTPServer) -> None:
    listed = (200, "application/json", b'{"data": [{"id": "a", "max_model_len": 4096}, {"id": "b"}]}')
    assert _discover(server, listed, None) == ("a", 4096)
    assert _discover(server, listed, "b") == ("b", None)
    assert _discover(server, (200, "application/json", b'{"data": []}'), "k3") == ("k3", None)  # named: sent as given


def test_a_url_that_is_not_one_is_said_in_one_line() -> None:
    with pytest.raises(TargetUnusable, match=r"does not answer /v1/models \(InvalidURL\)"):
        TargetApi("http://[::1", OPTIONS).discover(None)
