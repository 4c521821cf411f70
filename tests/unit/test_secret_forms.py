"""Secrets at rest (issue 36, item 5): a secret echoed in any encoding a server may use (JSON escapes of
any subset of its characters, percent-encoding, base64 as in a Basic credential) is redacted, in text,
in bytes and in a file copied in chunks; text without a secret is never changed. Property-based: random
secrets, random encodings, random text around them (no sockets, tmp dirs only).

`leaks` (tests/secret_scan.py) is the check, written apart from the redactor: it decodes instead of
matching encodings.
"""

from __future__ import annotations

import base64
import io
import json
import string
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from k3load.client.access import REDACTED, Secrets
from k3load.client.secret_forms import Redactor
from k3load.rundir import copy_file_redacted
from tests.secret_scan import encodings, leaks

PRINTABLE = "".join(chr(c) for c in range(0x20, 0x7F))
SETTINGS = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# -- strategies -------------------------------------------------------------------------------------
secrets_st = st.text(alphabet=PRINTABLE, min_size=6, max_size=32).map(str.strip).filter(lambda s: len(s) >= 6)
around_st = st.text(max_size=60)  # any text: a JSON line, a log, a body (no surrogates)


def _char_form(c: str, choice: int) -> str:
    forms = [c, f"\\u{ord(c):04x}", f"\\u{ord(c):04X}", f"%{ord(c):02x}", f"%{ord(c):02X}"]
    forms += {"/": ["\\/"], '"': ['\\"'], "\\": ["\\\\"], " ": ["+"]}.get(c, [])
    return forms[choice % len(forms)]


@st.composite
def encoded_st(draw: st.DrawFn, secret: str) -> str:
    """`secret` as a server may echo it: whole-value encodings, or each character its own way."""
    kind = draw(st.sampled_from(["mixed", "json", "all-u", "quote", "quote_plus", "base64", "basic"]))
    if kind == "mixed":
        return "".join(_char_form(c, draw(st.integers(0, 7))) for c in secret)
    if kind == "json":
        return json.dumps(secret)[1:-1]
    if kind == "all-u":
        return "".join(f"\\u{ord(c):04x}" for c in secret)
    if kind in ("quote", "quote_plus"):
        return (quote if kind == "quote" else quote_plus)(secret, safe=draw(st.sampled_from(["", "/", "-_.~"])))
    before = draw(st.binary(max_size=7)) if kind == "base64" else draw(st.text(string.ascii_letters, max_size=9)) \
        .encode() + b":"
    after = draw(st.binary(max_size=7)) if kind == "base64" else b""
    encode = draw(st.sampled_from([base64.b64encode, base64.urlsafe_b64encode]))
    return encode(before + secret.encode() + after).decode()


# -- properties -------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data(), secret=secrets_st, before=around_st, after=around_st)
def test_a_secret_in_any_encoding_is_redacted_and_the_text_around_it_kept(data: st.DataObject, secret: str,
                                                                          before: str, after: str) -> None:
    assume(not leaks(before + after, secret))  # the text around it holds no other copy
    encoded = data.draw(encoded_st(secret))
    for redact in (Redactor([secret]).redact, Secrets(secret).redact):
        out = redact(before + " " + encoded + " " + after)
        assert not leaks(out, secret), (encoded, out)
        assert REDACTED in out
    raw = (before + " " + encoded + " " + after).encode()
    assert not leaks(Redactor([secret]).redact_bytes(raw).decode(), secret)


@SETTINGS
@given(secret=secrets_st, text=st.text(max_size=300))
def test_text_without_the_secret_is_never_changed(secret: str, text: str) -> None:
    assume(not leaks(text, secret))
    redactor = Redactor([secret])
    assert redactor.redact(text) == text
    assert redactor.redact_bytes(text.encode()) == text.encode()


@SETTINGS
@given(data=st.data(), secret=secrets_st, before=around_st, after=around_st)
def test_a_json_line_stays_json_with_the_secret_in_it_escaped_any_way(data: st.DataObject, secret: str,
                                                                      before: str, after: str) -> None:
    """The records' lines are scrubbed whole: a redaction never breaks a line (an escaped backslash before
    a `\\u0073k...` goes with it)."""
    encoded = data.draw(encoded_st(secret))
    line = json.dumps({"error_body": before + encoded + after, "n": 1}, ensure_ascii=data.draw(st.booleans()))
    out = Redactor([secret]).redact(line)
    assert json.loads(out)["n"] == 1 and not leaks(json.loads(out)["error_body"], secret)


@SETTINGS
@given(data=st.data(), secret=secrets_st, pieces=st.lists(around_st, min_size=1, max_size=6),
       chunk=st.integers(1, 64))
def test_a_file_copied_in_chunks_never_holds_a_secret_cut_by_a_chunk_end(tmp_path_factory: pytest.TempPathFactory,
                                                                         data: st.DataObject, secret: str,
                                                                         pieces: list[str], chunk: int) -> None:
    assume(not leaks("".join(pieces), secret))
    text = (" " + data.draw(encoded_st(secret)) + " ").join(pieces)
    dst = tmp_path_factory.mktemp("copy") / "startup.log"
    copied = copy_file_redacted(io.BytesIO(text.encode()), dst, Secrets(secret), chunk_bytes=chunk)
    out = dst.read_bytes()
    assert not leaks(out.decode(), secret) and copied.redacted == (len(pieces) > 1)
    assert out == Redactor([secret]).redact_bytes(text.encode())
    if len(pieces) == 1:
        assert out == text.encode()


# -- examples ---------------------------------------------------------------------------------------
KEY = "sk-k3-SECRET-4f9a2c"


@pytest.mark.parametrize("echo", [
    KEY, *encodings(KEY).values(), "".join(f"\\u{ord(c):04X}" for c in KEY), "\\u0073k-k3-SECRET-4f9a2c",
    "\\\\u0073k-k3\\\\u002dSECRET-4f9a2c", "s%6B-k3\\u002DSECRET-4f9a2c",
    base64.urlsafe_b64encode(b"\xff\xfe" + KEY.encode()).decode(),
])
def test_each_encoding_of_the_key(echo: str) -> None:
    assert leaks(echo, KEY)  # the check sees it
    out = Secrets(KEY).redact(f'{{"error": "bad token {echo}"}}')
    assert not leaks(out, KEY) and REDACTED in out and out.startswith('{"error": "bad token ')


def test_a_header_credential_is_also_redacted_alone_and_a_basic_one_decoded() -> None:
    basic = base64.b64encode(b"probe:pw-SECRET-9x").decode()
    secrets = Secrets.parse(None, [f"Authorization: Basic {basic}", "X-Gateway: Bearer gw-SECRET-77d1"])
    out = secrets.redact(f"got {basic}; user probe:pw-SECRET-9x; pw pw-SECRET-9x; token gw-SECRET-77d1")
    assert "SECRET" not in out and out.count(REDACTED) == 4 and "probe:" in out  # the user name is no secret
    assert secrets.redact("Bearer gw-SECRET-77d1") == f"Bearer {REDACTED}"


def test_a_secret_with_slash_quote_space_and_backslash() -> None:
    secret = 'a/b "c d" e\\f'
    redactor = Redactor([secret])
    for echo in (json.dumps(secret)[1:-1], json.dumps(secret).replace("/", "\\/")[1:-1], quote_plus(secret),
                 quote(secret, safe="")):
        line = json.dumps({"e": f"x {echo} y"})
        assert not leaks(redactor.redact(line), secret) and json.loads(redactor.redact(line))["e"].startswith("x ")


def test_no_secrets_no_change_and_no_pattern() -> None:
    empty = Redactor([])
    assert not empty and empty.redact("a \\u0073 %41 b") == "a \\u0073 %41 b" and not Secrets()


def test_the_copy_counts_and_hashes_what_it_wrote(tmp_path: Path) -> None:
    import hashlib

    src = tmp_path / "in.log"
    src.write_bytes(f"line 1 --api-key {KEY}\nline 2\n".encode() * 1000)
    copied = copy_file_redacted(src, tmp_path / "out" / "copy.log", Secrets(KEY), chunk_bytes=1000)
    out = (tmp_path / "out" / "copy.log").read_bytes()
    assert copied.redacted and copied.bytes == len(out) and copied.sha256 == hashlib.sha256(out).hexdigest()
    assert out.count(REDACTED.encode()) == 1000 and KEY.encode() not in out
