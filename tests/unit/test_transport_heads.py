"""The gevent transport's request heads: built once per path, shared headers and body length, with each request's
own X-Request-Id added, so the cache hits although every request carries a new id (issue 31, item 3: it held 256
heads a user and never hit). No socket: the head is what `open` sends before the body."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3load.client.access import PER_REQUEST_HEADER
from k3load.client.transport import GeventTransport

PATH = "/v1/chat/completions"
SHARED = {"Content-Type": "application/json", "Authorization": "Bearer k"}


def _lines(head: bytes) -> tuple[bytes, list[bytes]]:
    """(the request line, the header lines in any order) of a head ending in a blank line."""
    assert head.endswith(b"\r\n\r\n")
    first, *fields = head[:-4].split(b"\r\n")
    return first, sorted(fields)


def _transport() -> GeventTransport:
    return GeventTransport("http://127.0.0.1:9/", 1.0, 1)  # never connects: only heads are built


def test_every_request_id_shares_one_cached_head():
    transport, body = _transport(), b"{}" * 50
    for i in range(20):
        headers = {**SHARED, PER_REQUEST_HEADER: f"k3load-{i}"}
        head = transport._head(PATH, body, headers)
        built = transport._client._build_request("POST", PATH, body=body, headers=dict(headers)).encode("latin-1")
        assert _lines(head) == _lines(built)
        assert f"{PER_REQUEST_HEADER}: k3load-{i}\r\n".encode() in head
    assert len(transport._heads) == 1
    assert transport._head(PATH, body, SHARED) == transport._heads[(PATH, tuple(SHARED.items()), len(body))]
    lower = transport._head(PATH, body, {**SHARED, "x-request-id": "k3load-x", PER_REQUEST_HEADER: "k3load-y"})
    assert lower.lower().count(b"x-request-id") == 1 and len(transport._heads) == 1  # however spelt: once
    with pytest.raises(ValueError, match="X-Request-Id"):
        transport._head(PATH, body, {**SHARED, PER_REQUEST_HEADER: "a\x01b"})


@given(value=st.text(max_size=40))
def test_any_request_id_gives_the_head_geventhttpclient_builds_or_its_refusal(value):
    """Any id: the same header lines as `_build_request` writes (order aside), or a ValueError where it refuses the
    value too (control characters, characters past Latin-1 that its check lets through fail to encode there)."""
    transport, body = _transport(), b'{"a": 1}'
    headers = {**SHARED, PER_REQUEST_HEADER: value}
    try:
        built = transport._client._build_request("POST", PATH, body=body, headers=dict(headers)).encode("latin-1")
    except (ValueError, UnicodeEncodeError):
        with pytest.raises(ValueError):
            transport._head(PATH, body, headers)
        return
    assert _lines(transport._head(PATH, body, headers)) == _lines(built)
