"""The redirect and plain-HTTP rules on their own (issue 36, items 4 and 6): origins, redirect kinds, the notes of
the clients that never follow, and the one-line warning when a key would cross plain HTTP to a host off
loopback, from the origin helpers and from the standalone sample and precheck commands.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from k3load.client.origin import (
    BAD_SCHEME,
    DOWNGRADE,
    OTHER_ORIGIN,
    SAME_ORIGIN,
    is_loopback,
    origin,
    plain_http_warning,
    redirect_kind,
    redirect_note,
    same_origin,
)
from k3load.precheck import PrecheckError
from k3load.precheck import cli as precheck_cli
from k3load.sampler import cli as sample_cli
from tests.sim.redirect_servers import KEY, ROOT


# -- the helpers -------------------------------------------------------------------------------------------
def test_origins_and_redirect_kinds() -> None:
    assert same_origin("http://h/metrics", "http://h:80/health") and same_origin("HTTPS://H:443/a", "https://h/b")
    assert not same_origin("http://h/m", "https://h/m") and not same_origin("http://h/m", "http://h:81/m")
    assert not same_origin("http://[::1/m", "http://[::1/m") and not same_origin("http://h:x/", "http://h:x/")
    assert not same_origin("http://h/m", None) and not same_origin("file:///a", "file:///a")
    assert origin("http://user:pw@[::1]:9/x?q#f") == "http://[::1]:9" and origin("https://h/x") == "https://h:443"
    assert origin("file:///etc/passwd") == "file:" and origin("http://[::1") == "(unparsable URL)"
    assert redirect_kind("http://h/a", "http://h/b") == SAME_ORIGIN
    assert redirect_kind("http://h/a", "https://h/b") == OTHER_ORIGIN  # an upgrade: followed, without them
    assert redirect_kind("https://h/a", "http://h/b") == DOWNGRADE
    assert redirect_kind("https://h/a", "http://other/b") == DOWNGRADE
    assert {redirect_kind("http://h/a", u) for u in ("ftp://h/", "file:///x", "javascript:x", "http:///x",
                                                     "http://[::1")} == {BAD_SCHEME}


def test_redirect_notes_for_the_clients_that_never_follow() -> None:
    assert redirect_note(200, "http://x/") == "" and redirect_note(None, None) == ""
    assert redirect_note(302, "http://u:p@10.0.0.9:8000/v1") == "redirect to http://10.0.0.9:8000 not followed"
    assert redirect_note(307, "/v1/chat") == "redirect to a path on the same origin not followed"
    assert redirect_note(307, "/v1/chat", "http://h:1/x") == "redirect to http://h:1 not followed"
    assert redirect_note(301, None) == "redirect without a Location, not followed"
    assert redirect_note(302, "http://[::1") == "redirect to (unparsable URL) not followed"


@pytest.mark.parametrize(("url", "secrets", "warned"), [
    ("http://10.0.0.5:8000", True, True), ("http://vllm.example:8000/v1", True, True),
    ("http://[2001:db8::1]:80", True, True), ("http://127.0.0.2:8000", True, False),
    ("http://localhost:8000", True, False), ("http://LOCALHOST.:8000", True, False), ("http://[::1]:8000", True, False),
    ("http://[::ffff:127.0.0.1]:8000", True, False), ("https://10.0.0.5", True, False),
    ("http://10.0.0.5:8000", False, False), ("http://[::1", True, False),
])
def test_plain_http_warning_only_for_secrets_to_a_host_off_loopback(url: str, secrets: bool, warned: bool) -> None:
    line = plain_http_warning(url, secrets)
    assert (line is not None) == warned, line
    if line is not None:
        assert "\n" not in line and origin(url) in line and "https://" in line
    assert is_loopback("127.255.0.1") and not is_loopback("128.0.0.1") and not is_loopback(None)


# -- the plain-HTTP warning of the standalone commands -----------------------------------------------------
class _IdleSampler:
    """Stands in for the Sampler: the warning is said before it starts, from the URLs it was given."""

    def __init__(self, out: Path, metrics_url: list[str], **kwargs: Any) -> None:
        self.metrics_url, self.health_url = metrics_url[0], kwargs.get("health_url")

    def start(self) -> _IdleSampler:
        return self

    def stop(self) -> dict[str, Any]:
        return {}


def _parsed(add_arguments: Callable[[Any], None], argv: list[str]) -> Any:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(("url", "key", "warned"), [("http://10.0.0.5:8000", KEY, True),
                                                    ("http://127.0.0.1:8000", KEY, False),
                                                    ("http://10.0.0.5:8000", None, False)])
def test_sample_and_precheck_warn_once_about_a_key_over_plain_http(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str], url: str,
                                                                   key: str | None, warned: bool) -> None:
    if key:
        monkeypatch.setenv("K3_API_KEY", key)
    else:
        monkeypatch.delenv("K3_API_KEY", raising=False)
    monkeypatch.setattr(sample_cli, "Sampler", _IdleSampler)
    sample_cli.run(_parsed(sample_cli.add_arguments, ["--metrics-url", f"{url}/metrics", "--duration", "0.01",
                                                      "--out", str(tmp_path / "s")]))

    def gathered(*_args: Any, **_kwargs: Any) -> dict[str, Any]:
        raise PrecheckError("not gathered here")

    monkeypatch.setattr(precheck_cli, "run_precheck", gathered)
    precheck_cli.run(_parsed(precheck_cli.add_arguments, ["--recipe", str(ROOT / "recipes" / "local-dev.yaml"),
                                                          "--base-url", url, "--out", str(tmp_path / "p")]))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "plain HTTP" in line]
    assert warnings == ([plain_http_warning(url, True)] * 2 if warned else []), warnings
    assert all(KEY not in line for line in warnings)
