"""Debian's real nginx in front of test servers (the sim), unprivileged on a free loopback port.

Why: production puts a gateway between the client and vLLM, and nginx's defaults (`proxy_pass` alone:
HTTP/1.0 upstream, `proxy_buffering on`) change what a client sees of a stream. Tests that judge gateways
run the real thing instead of imitating it. Usage::

    config = ProxyConfig(upstreams=(sim.base_url,), buffering=False, read_timeout_s=1.0)
    with NginxProxy(config, tmp_path / "nginx") as proxy:
        httpx.get(proxy.base_url + "/v1/models", headers={"X-Request-Id": "r-1"})
        [line] = proxy.log_for("r-1")  # its access-log line: status, upstream_addr, ...

or, one nginx per config shared by a module::

    @pytest.fixture(scope="module")
    def start_nginx(tmp_path_factory):
        yield from nginx_factory(tmp_path_factory.mktemp("nginx"))

Everything nginx writes (config, logs, pid, temp files) stays in its own folder, started with `-p DIR -c
FILE -e LOG` and `daemon off;`, so it needs no root. A missing nginx skips outside CI and fails under
CI=true (`make nginx` installs Debian's), as the prometheus and chromium tests do.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, whatever http_proxy says
READY_PATH = "/__nginx_ready"  # answered by nginx itself, so readiness does not depend on an upstream
# One JSON object per request: the client's X-Request-Id and nginx's own id find a request in the log.
LOG_FIELDS = {"request_id": "$http_x_request_id", "nginx_request_id": "$request_id", "status": "$status",
              "method": "$request_method", "uri": "$request_uri", "upstream_addr": "$upstream_addr",
              "upstream_status": "$upstream_status", "bytes_sent": "$bytes_sent", "request_time": "$request_time",
              "upstream_response_time": "$upstream_response_time"}


def nginx_binary() -> str:
    """Debian's nginx (on PATH or in /usr/sbin, which a non-root PATH may lack); skip or, under CI, fail."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("nginx is missing on CI: `make test` installs Debian's nginx first")
    pytest.skip("nginx is not installed here (make test / make nginx installs it on Debian)")


@dataclass(frozen=True)
class ProxyConfig:
    """What one nginx does in front of its upstreams.

    `upstreams`: base URLs `http://127.0.0.1:PORT`, round-robin unless `affinity_header` names a request
    header whose value picks the upstream (`hash $http_<name> consistent`, as session-affinity routers do).
    `buffering=True` is nginx's default `proxy_pass` (HTTP/1.0 upstream, the response buffered);
    False is the fix for streams (`proxy_buffering off`, HTTP/1.1 with keep-alive's empty Connection).
    `read_timeout_s`: `proxy_read_timeout`, the longest silence nginx allows its upstream (default 60 s).
    """

    upstreams: tuple[str, ...]
    buffering: bool = True
    read_timeout_s: float = 60.0
    affinity_header: str | None = None

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ValueError("at least one upstream")
        for url in self.upstreams:
            if not url.startswith("http://") or "/" in url.removeprefix("http://").rstrip("/"):
                raise ValueError(f"an upstream is http://HOST:PORT, not {url!r}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be positive, not {self.read_timeout_s!r}")
        if self.affinity_header is not None and not self.affinity_header.replace("-", "").isalnum():
            raise ValueError(f"affinity_header is a header name, not {self.affinity_header!r}")


def render(config: ProxyConfig, folder: Path, port: int) -> str:
    """nginx.conf for `config`, listening on 127.0.0.1:`port`, every path it writes inside `folder`."""
    servers = "".join(f"    server {url.removeprefix('http://').rstrip('/')};\n" for url in config.upstreams)
    balance = ""
    if config.affinity_header:
        balance = f"    hash $http_{config.affinity_header.lower().replace('-', '_')} consistent;\n"
    fields = ",".join(f'"{name}":"{variable}"' for name, variable in LOG_FIELDS.items())
    stream = ("" if config.buffering else
              "      proxy_buffering off;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n")
    temp = "".join(f"  {kind}_temp_path {folder / ('tmp-' + kind)};\n"
                   for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    user = "user root;\n" if os.geteuid() == 0 else ""  # as root, workers would drop to nobody: no access here
    return (f"{user}daemon off;\nworker_processes 1;\npid {folder / 'nginx.pid'};\n"
            f"error_log {folder / 'error.log'} info;\nevents {{ worker_connections 256; }}\n"
            f"http {{\n{temp}"
            f"  log_format k3 escape=json '{{{fields}}}';\n  access_log {folder / 'access.log'} k3;\n"
            f"  upstream k3 {{\n{balance}{servers}  }}\n"
            f"  server {{\n    listen 127.0.0.1:{port};\n"
            f"    location = {READY_PATH} {{ access_log off; return 204; }}\n"
            f"    location / {{\n      proxy_pass http://k3;\n{stream}"
            f"      proxy_read_timeout {round(config.read_timeout_s * 1000)}ms;\n    }}\n  }}\n}}\n")


class NginxProxy:
    """A running nginx for one `ProxyConfig`; `stop()` (or leaving the context) ends it, SIGQUIT then SIGKILL."""

    def __init__(self, config: ProxyConfig, folder: Path, startup_timeout_s: float = 15.0) -> None:
        self.config = config
        self.folder = folder
        self.startup_timeout_s = startup_timeout_s
        self.base_url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def access_log(self) -> Path:
        return self.folder / "access.log"

    @property
    def error_log(self) -> Path:
        return self.folder / "error.log"

    def start(self) -> NginxProxy:
        binary = nginx_binary()
        self.folder.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):  # a free port can be taken between the probe and nginx's bind
            port = _free_port()
            (self.folder / "nginx.conf").write_text(render(self.config, self.folder, port))
            with (self.folder / "stderr.log").open("ab") as out:
                self.proc = subprocess.Popen([binary, "-p", str(self.folder), "-c", str(self.folder / "nginx.conf"),
                                              "-e", str(self.error_log)], stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
            self.base_url = f"http://127.0.0.1:{port}"
            if self._wait_ready():
                return self
            self.stop()
            if "in use" not in self._logs() or attempt == 2:
                break
        raise RuntimeError(f"nginx did not start: {self._logs()[-2000:]}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline and self.proc is not None and self.proc.poll() is None:
            try:
                with _DIRECT.open(self.base_url + READY_PATH, timeout=2) as response:
                    return response.status == 204
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        return False

    def _logs(self) -> str:
        return "".join(path.read_text(errors="replace") for path in (self.folder / "stderr.log", self.error_log)
                       if path.exists())

    def log_lines(self) -> list[dict[str, Any]]:
        """The access log so far, one dict per request (fields of LOG_FIELDS; "" where nginx wrote none)."""
        if not self.access_log.exists():
            return []
        lines = [json.loads(line) for line in self.access_log.read_text().splitlines() if line.strip()]
        return [{key: "" if value == "-" else value for key, value in line.items()} for line in lines]

    def log_for(self, request_id: str, count: int = 1, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """The access-log lines of the requests that carried `X-Request-Id: request_id`, waiting up to
        `timeout_s` for `count` of them: nginx writes a line as it ends the request, which can be just after
        the client saw the end of its answer."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [line for line in self.log_lines() if line["request_id"] == request_id]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.02)

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Graceful stop (SIGQUIT lets open requests finish), then SIGKILL to nginx's own process group."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # the master exits after its workers
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:  # still unreaped, so its group id is still ours
                os.killpg(self.proc.pid, signal.SIGKILL)  # its workers too: the group nginx started in
                self.proc.wait(timeout_s)
        return self.proc.returncode

    def __enter__(self) -> NginxProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def nginx_factory(folder: Path) -> Iterator[Callable[[ProxyConfig], NginxProxy]]:
    """A fixture body: `yield from nginx_factory(dir)` gives start(config) -> a running nginx, each in its own
    subfolder of `dir`, all stopped when the fixture ends (function- or module-scoped, as the caller says)."""
    started: list[NginxProxy] = []

    def start(config: ProxyConfig) -> NginxProxy:
        proxy = NginxProxy(config, folder / f"nginx-{len(started)}")
        started.append(proxy)
        return proxy.start()

    try:
        yield start
    finally:
        for proxy in started:
            proxy.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
