"""Redaction of an imported agent log (issue 28, k3load.traffic.redact): every kind found where logs hold it
(plain strings, escaped JSON inside strings, dict keys), near misses left alone, placeholders stable, of the
value's shape and length, and safe for the JSON around them; the summary holds numbers only.

Property-based for the promise that matters: random JSON documents with secrets of each kind planted at random
places never show a planted value again, in either encoding `json.dumps` can write. No sockets, no files.
"""

from __future__ import annotations

import json
import re
import string
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3load.traffic.redact import FILLER, MAX_GROWTH, LogRedactor, RedactPatternError, SecretKind

SAFE = re.compile(r"[A-Za-z0-9@.+() _-]*")  # what a placeholder may hold: nothing to escape in JSON or YAML

AKIA = "AKIAIOSFODNN7EXAMPLE"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
PEM_BODY = "MIIEowIBAAKCAQEA7bq1X2xv9GqXa+Lk0Wc3/3nUPZfQ8lq8FQ9bm3GkPZlY0oC1u1JqZxF3"


# -- each kind --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "kind", "secret"), [
    ("key sk-proj-4f9aXcQ2mK7pR9vT4wL8nB3cZ6hJ5 here", SecretKind.API_KEY, "4f9aXcQ2mK7pR9vT4wL8nB3cZ6hJ5"),
    ("sk-ant-api03-AbCdEf1234567890abcdefXYZ", SecretKind.API_KEY, "AbCdEf1234567890abcdefXYZ"),
    ("sk-4f9aXcQ2mK7pR9vT4wL8nB3cZ6hJ5dF1gS0yUeN4tQ8r", SecretKind.API_KEY, "4f9aXcQ2mK7pR9vT4wL8"),
    (f"aws_access_key_id={AKIA}", SecretKind.API_KEY, AKIA),
    ("ASIAY34FZKBOKMUTVV7A,", SecretKind.API_KEY, "ASIAY34FZKBOKMUTVV7A"),
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", SecretKind.API_KEY, "wJalrXUtnFEMI"),
    ("ghp_abcdefghijklmnopqrstuvwxyz0123456789", SecretKind.API_KEY, "abcdefghijklmnopqrstuvwxyz0123456789"),
    ("github_pat_11ABCDEFG0abcdefghijklmnopqrstuvwxyz_0123456789", SecretKind.API_KEY, "11ABCDEFG0abcdefghijk"),
    ("glpat-abcdefghij0123456789", SecretKind.API_KEY, "abcdefghij0123456789"),
    ("SLACK=xoxb-1234567890-abcdefghij", SecretKind.API_KEY, "1234567890-abcdefghij"),
    ("AIzaSyA1234567890abcdefghijklmnopqrstuv", SecretKind.API_KEY, "SyA1234567890abcdefghijklmnopqrstuv"),
    ("HF hf_abcdefghijklmnopqrstuvwxyz01234567", SecretKind.API_KEY, "abcdefghijklmnopqrstuvwxyz01234567"),
    ("stripe sk_live_abcdefghij0123456789", SecretKind.API_KEY, "abcdefghij0123456789"),
    ("rk_live_abcdefghij0123456789", SecretKind.API_KEY, "abcdefghij0123456789"),
    ('{"api_key":"abc123xyz"}', SecretKind.API_KEY, "abc123xyz"),
    ('{\\"api_key\\": \\"abc123xyz\\"}', SecretKind.API_KEY, "abc123xyz"),  # JSON inside a JSON string
    ("OPENAI_API_KEY='q8ZbC4kq1'", SecretKind.API_KEY, "q8ZbC4kq1"),
    ("password: hunter2", SecretKind.API_KEY, "hunter2"),
    ('{"db_password": "correct horse battery"}', SecretKind.API_KEY, "correct horse"),
    ("GITHUB_TOKEN=a1b2c3d4e5f6", SecretKind.API_KEY, "a1b2c3d4e5f6"),
    ("?client_secret=Zx81kLmN0pQ&x=1", SecretKind.API_KEY, "Zx81kLmN0pQ"),
    (f"jwt {JWT}", SecretKind.BEARER, JWT),
    ("Authorization: Bearer abc123def456ghi789", SecretKind.BEARER, "abc123def456ghi789"),
    ("curl -H 'authorization: Basic dXNlcjpwYXNzd29yZA=='", SecretKind.BEARER, "dXNlcjpwYXNzd29yZA=="),
    ('"Authorization": "tok_9f8e7d6c5b4a"', SecretKind.BEARER, "tok_9f8e7d6c5b4a"),
    ("use bearer 0a1b2c3d4e5f60718293", SecretKind.BEARER, "0a1b2c3d4e5f60718293"),
    (f"-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\n-----END RSA PRIVATE KEY-----\n", SecretKind.PRIVATE_KEY,
     PEM_BODY[:20]),
    (f'"-----BEGIN PRIVATE KEY-----\\n{PEM_BODY}\\n{PEM_BODY}\\n-----END PRIVATE KEY-----\\n"',
     SecretKind.PRIVATE_KEY, PEM_BODY[30:]),
    (f"-----BEGIN OPENSSH PRIVATE KEY-----\n{PEM_BODY}\n", SecretKind.PRIVATE_KEY, PEM_BODY[10:]),  # cut off
    ("mail bob.smith+ops@acme-corp.example.com now", SecretKind.EMAIL, "bob.smith+ops@acme-corp"),
    ("to:\\nbob@acme.io", SecretKind.EMAIL, "bob@acme.io"),
    ("\\u201cjane@acme.io\\u201d", SecretKind.EMAIL, "jane@acme.io"),
    ("call +1 (415) 555-0123 today", SecretKind.PHONE, "415) 555-0123"),
    ("+14155550123", SecretKind.PHONE, "4155550123"),
    ("+44 20 7946 0958", SecretKind.PHONE, "7946 0958"),
    ("(415) 555-0123", SecretKind.PHONE, "555-0123"),
    ("415-555-0123.", SecretKind.PHONE, "555-0123"),
    ("415.555.0123", SecretKind.PHONE, "555.0123"),
    ("1-415-555-0123", SecretKind.PHONE, "415-555"),
    ("tel 020 7946 0958", SecretKind.PHONE, "7946 0958"),
    ("\\n+49 30 12345678", SecretKind.PHONE, "12345678"),
])
def test_each_kind_is_replaced_and_counted(text: str, kind: SecretKind, secret: str) -> None:
    redactor = LogRedactor()
    out = redactor.text(text)
    assert secret not in out, out
    assert redactor.counts() == {k.value: int(k is kind) for k in SecretKind}, out
    assert out.count('"') == text.count('"') and out.count("\\") <= text.count("\\")


def test_the_scheme_word_and_the_header_name_stay() -> None:
    redactor = LogRedactor()
    assert redactor.text("Authorization: Bearer abc123def456ghi789").startswith("Authorization: Bearer REDACTED-")
    assert redactor.text("Authorization: Basic dXNlcjpwYXNzd29yZA==").startswith("Authorization: Basic REDACTED-")


@pytest.mark.parametrize("text", [
    "a risk-free, task-based plan: sk-learn-style-estimators-everywhere-here", "123e4567-e89b-12d3-a456-426614174000",
    "2024-01-15T10:30:45.123+05:30", "2024-01-15 10:30:45Z", "version 1.2.3.4", "v0.27.1rc1.dev5+g1234",
    "costs $1,234.56 or €99.99", "order 123456789012", "id 4155550123", "build 20240115103045", "192.168.100.254",
    "4111-1111-1111-1111 card-like id", '{"token": "Hello", "logprob": -0.25}', '{"max_tokens": 100}',
    '{"token": 12345678}', "the bearer of bad news", "bearer tokens are short-lived", "user@localhost",
    "tokenizer: meta-llama/Llama-3.1-8B", "password: null", "sk-short", "AKIA1234", "x +1 2", "1 + 2 = 3",
    "ratio 1:2:3", "+1000 points", "3.14159 26535 89793", "0xDEADBEEF", "sha 9f86d081884c7d659a2feaa0c55ad015",
])
def test_near_misses_are_left_alone(text: str) -> None:
    redactor = LogRedactor()
    assert redactor.text(text) == text
    assert sum(redactor.counts().values()) == 0


def test_escaped_json_inside_a_string_still_parses_and_loses_its_secrets() -> None:
    result = json.dumps({"api_key": "abc123xyz", "auth": "Bearer abc123def456ghi789", "to": "a.b@c.io",
                         "pem": f"-----BEGIN EC PRIVATE KEY-----\n{PEM_BODY}\n-----END EC PRIVATE KEY-----"})
    call = {"type": "function", "function": {"name": "send", "arguments": json.dumps({"tool_result": result})}}
    out = LogRedactor().value(call)
    inner = json.loads(json.loads(out["function"]["arguments"])["tool_result"])
    assert list(inner) == ["api_key", "auth", "to", "pem"]
    assert not {"abc123xyz", "abc123def456ghi789", "a.b@c.io", PEM_BODY} & {*inner.values()}
    assert inner["auth"].startswith("Bearer ") and inner["pem"].startswith("-----BEGIN EC PRIVATE KEY-----")


# -- value(): keys, order, a new object ------------------------------------------------------------------
def test_value_keeps_key_order_redacts_keys_and_leaves_the_input_alone() -> None:
    doc: dict[str, Any] = {"z": 1, "bob@acme.io": ["call +1 415 555 0123", 2.5, None, True], "a": {"y": "x"}}
    before = json.dumps(doc)
    out = LogRedactor().value(doc)
    assert json.dumps(doc) == before and out is not doc
    assert list(out) == ["z", "u0001@x.invalid", "a"]
    assert out["u0001@x.invalid"][1:] == [2.5, None, True] and out["a"] == {"y": "x"}
    assert "555 0123" not in json.dumps(out)


# -- placeholders ----------------------------------------------------------------------------------------
def test_same_value_same_placeholder_different_values_different_ones_and_reimports_identical() -> None:
    log = [f"system: keys sk-proj-{c}4f9aXcQ2mK7pR9vT4wL8nB3 for {c}@acme.io, +1 415 555 01{i:02d}"
           for i, c in enumerate("abcab")]
    first, second = LogRedactor(), LogRedactor()
    out = [first.text(line) for line in log]
    assert out == [second.text(line) for line in log]  # a re-import writes the same bytes
    assert out[0][:40] == out[3][:40] and out[1][:40] == out[4][:40] and len({out[0], out[1], out[2]}) == 3
    assert first.counts()["api_key"] == 5 and first.distinct() == {
        "api_key": 3, "bearer_token": 0, "private_key": 0, "email": 3, "phone": 5, "pattern": 0}


def test_placeholders_keep_the_shape_and_length_and_hold_nothing_to_escape() -> None:
    redactor = LogRedactor()
    email, phone = "jane.doe.the.third@acme-corp.io", "+44 (20) 7946-0958"
    key = "sk-proj-4f9aXcQ2mK7pR9vT4wL8nB3cZ6hJ5dF1gS0"
    out_email, out_phone, out_key = redactor.text(email), redactor.text(phone), redactor.text(key)
    assert re.fullmatch(r"user0001[A-Za-z0-9]*@example\.invalid", out_email) and len(out_email) == len(email)
    assert re.fullmatch(r"\+\d\d \(\d\d\) \d{4}-\d{4}", out_phone) and out_phone.startswith("+55 (50)")
    assert out_key.startswith("REDACTED-api_key-0001-") and len(out_key) == len(key)
    assert all(SAFE.fullmatch(p) for p in (out_email, out_phone, out_key))
    padded = f"x {FILLER}-{FILLER}"  # the padding is found by nothing
    assert redactor.text(FILLER) == FILLER and redactor.text(padded) == padded


def test_the_summary_holds_counts_never_values() -> None:
    redactor = LogRedactor(["cust-(\\d{6})"])
    redactor.value({"k": "bob@acme.io cust-123456 sk-proj-4f9aXcQ2mK7pR9vT4wL8nB3"})
    for summary in (redactor.counts(), redactor.distinct()):
        assert set(summary) == {k.value for k in SecretKind}
        assert all(type(n) is int for n in summary.values())
    assert "bob" not in json.dumps([redactor.counts(), redactor.distinct()])


# -- --redact-pattern ------------------------------------------------------------------------------------
def test_extra_patterns_replace_group_one_or_the_whole_match_under_pattern() -> None:
    redactor = LogRedactor([r"customer=(\d+)", r"ACME-\d{4}-[A-Z]{4}"])
    out = redactor.text("customer=88123401 ticket ACME-2024-ABCD bob@acme.io")
    assert out.startswith("customer=REDACTED-pattern-0001 ticket REDACTED-pattern-0002") and "bob@" not in out
    assert redactor.counts()["pattern"] == 2 and redactor.counts()["email"] == 1
    assert redactor.text(out) == out and redactor.counts()["pattern"] == 2


@pytest.mark.parametrize("pattern", ["(unclosed", "a*", "x?|y", "(?:)"])
def test_a_bad_extra_pattern_is_refused_by_name(pattern: str) -> None:
    with pytest.raises(RedactPatternError, match=re.escape(repr(pattern))):
        LogRedactor([pattern])
    assert issubclass(RedactPatternError, ValueError)


# -- properties ------------------------------------------------------------------------------------------
ALNUM = string.ascii_letters + string.digits


def _chars(alphabet: str, low: int, high: int | None = None) -> st.SearchStrategy[str]:
    return st.text(alphabet=alphabet, min_size=low, max_size=high or low)


def _key(prefix: str, alphabet: str, low: int, high: int | None = None) -> st.SearchStrategy[tuple[str, list[str]]]:
    return _chars(alphabet, low, high).map(lambda body: (prefix + body + "7", [body + "7"]))


_AREA = st.integers(200, 999).filter(lambda n: n != 555).map(str)
_SUB = st.integers(0, 9999).map(lambda n: f"{n:04d}")


@st.composite
def _phone(draw: st.DrawFn) -> tuple[str, list[str]]:
    area, mid, sub = draw(_AREA), draw(st.integers(200, 999).map(str)), draw(_SUB)
    country, form = draw(st.sampled_from([("+1 ", "({a}) {m}-{s}"), ("+1", "{a}{m}{s}"), ("", "({a}) {m}-{s}"),
                                          ("", "{a}-{m}-{s}"), ("", "{a}.{m}.{s}"), ("+44 ", "{a} {m} {s}"),
                                          ("", "0{a} {m} {s}"), ("+49-", "{a}-{m}{s}")]))
    number = form.format(a=area, m=mid, s=sub)
    return country + number, [number]  # the area code is never 555: no placeholder holds the number


@st.composite
def _pem(draw: st.DrawFn) -> tuple[str, list[str]]:
    lines = draw(st.lists(_chars(string.ascii_letters + string.digits + "+/", 40, 64), min_size=1, max_size=3))
    label = draw(st.sampled_from(["", "RSA ", "EC ", "OPENSSH "]))
    return f"-----BEGIN {label}PRIVATE KEY-----\n" + "\n".join(lines) + f"\n-----END {label}PRIVATE KEY-----", lines


_VALUE = _chars(ALNUM, 10, 24).map(lambda v: v + "9")
SECRETS: dict[SecretKind, st.SearchStrategy[tuple[str, list[str]]]] = {
    SecretKind.API_KEY: st.one_of(
        st.sampled_from(["sk-", "sk-proj-", "sk-ant-api03-"]).flatmap(lambda p: _key(p, ALNUM + "_-", 24, 40)),
        _key("AKIA", string.ascii_uppercase + string.digits, 15), _key("ghp_", ALNUM, 36),
        _key("glpat-", ALNUM, 20), _key("xoxb-", ALNUM, 12, 30), _key("AIza", ALNUM + "_", 34),
        _key("hf_", ALNUM, 34), _key("sk_live_", ALNUM, 24),
        st.tuples(st.sampled_from(["api_key=", "password: ", "GITHUB_TOKEN="]), _VALUE).map(
            lambda t: (t[0] + t[1], [t[1]])),
        _VALUE.map(lambda v: (json.dumps({"api_key": v}), [v]))),
    SecretKind.BEARER: st.one_of(
        _VALUE.map(lambda v: ("Authorization: Bearer " + v, [v])),
        st.tuples(_chars(ALNUM, 10, 30), _chars(ALNUM, 10, 30), _chars(ALNUM + "_-", 10, 40)).map(
            lambda t: ("eyJ" + ".eyJ".join(t[:2]) + "." + t[2], ["eyJ" + ".eyJ".join(t[:2])]))),
    SecretKind.PRIVATE_KEY: _pem(),
    SecretKind.EMAIL: st.tuples(_chars(string.ascii_lowercase + string.digits, 3, 12),
                                _chars(string.ascii_lowercase, 3, 10), st.sampled_from(["com", "io", "co.uk"])).map(
        lambda t: (f"{t[0]}@{t[1]}.{t[2]}", [f"{t[0]}@{t[1]}"])),
    SecretKind.PHONE: _phone(),
}
SEPARATORS = st.sampled_from([" ", "\n", "\t", "“", "(", ", ", ": "])
NOISE = st.text(max_size=12)


@st.composite
def _planted(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A string holding one secret of a random kind, between random text, maybe JSON-encoded once or twice."""
    snippet, needles = draw(st.sampled_from(list(SECRETS)).flatmap(SECRETS.__getitem__))
    text = draw(NOISE) + draw(SEPARATORS) + snippet + draw(SEPARATORS) + draw(NOISE)
    for _ in range(draw(st.integers(0, 2))):  # a tool result that is JSON, inside a JSON arguments string...
        text = json.dumps({"result": text}, ensure_ascii=draw(st.booleans()))
    return text, needles


PLANT = "\x00plant\x00"  # where a secret goes, filled in after the skeleton is drawn


@st.composite
def _document(draw: st.DrawFn) -> tuple[Any, list[str]]:
    """A JSON document with secrets planted in its strings and its keys."""
    needles: list[str] = []

    def fill(obj: Any) -> Any:
        if obj == PLANT:
            planted, found = draw(_planted())
            needles.extend(found)
            return planted
        if isinstance(obj, dict):
            return {fill(k): fill(v) for k, v in obj.items()}
        return [fill(v) for v in obj] if isinstance(obj, list) else obj

    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=10), st.just(PLANT))
    doc = draw(st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.one_of(st.text(max_size=6), st.just(PLANT)), inner, max_size=3), max_leaves=8))
    return fill(doc), needles


def _shape(obj: Any) -> Any:
    """The structure of a JSON value: types, lengths and order, not the strings."""
    if isinstance(obj, dict):
        return ["dict", [_shape(v) for v in obj.values()]]
    if isinstance(obj, list):
        return ["list", [_shape(v) for v in obj]]
    return type(obj).__name__ if isinstance(obj, str) else obj


@given(_document())
def test_no_planted_secret_survives_in_either_json_encoding(planted: tuple[Any, list[str]]) -> None:
    doc, needles = planted
    out = LogRedactor().value(doc)
    assert _shape(out) == _shape(doc)
    for dumped in (json.dumps(out), json.dumps(out, ensure_ascii=False)):
        assert not [n for n in needles if n in dumped], dumped


@given(_document())
def test_redacting_twice_changes_nothing_more(planted: tuple[Any, list[str]]) -> None:
    redactor = LogRedactor()
    once = redactor.value(planted[0])
    counts = redactor.counts()
    assert redactor.value(once) == once and redactor.counts() == counts
    fresh = LogRedactor()  # the placeholders are known by their shape too, not only by the redactor that wrote them
    assert fresh.value(once) == once and not any(fresh.counts().values())


@given(st.text(alphabet=string.ascii_letters + string.digits + " .,;!?'\n", max_size=200))
def test_text_with_nothing_secret_like_is_unchanged(text: str) -> None:
    assert LogRedactor().text(text) == text


@given(st.sampled_from(list(SECRETS)).flatmap(SECRETS.__getitem__), NOISE, NOISE)
def test_a_placeholder_is_about_as_long_as_its_value(secret: tuple[str, list[str]], before: str, after: str) -> None:
    snippet = secret[0]
    text = f"{before} {snippet} {after}"
    out = LogRedactor().text(text)
    assert 0 <= len(out) - len(text) <= MAX_GROWTH
    if all(len(n) >= MAX_GROWTH for n in secret[1]) and not snippet.startswith(("password", "Authorization")):
        assert len(out) == len(text), (text, out)


@given(_document(), st.booleans())
def test_a_json_encoded_document_still_parses_with_the_same_structure(planted: tuple[Any, list[str]],
                                                                      ensure_ascii: bool) -> None:
    doc, needles = planted
    out = LogRedactor().text(json.dumps(doc, ensure_ascii=ensure_ascii))
    parsed = json.loads(out)
    assert _shape(parsed) == _shape(doc)
    assert not [n for n in needles if n in json.dumps(parsed, ensure_ascii=False)]


def test_a_member_named_for_a_secret_is_one_whatever_its_value_looks_like() -> None:
    """`{"client_secret": "a8f3kd92jfl3"}` as an object member, not text: replaced as the same text inside a
    string would be, the same placeholder in both places; words and numbers under such names are not."""
    redactor = LogRedactor()
    out = redactor.value({"metadata": {"client_secret": "a8f3kd92jfl3", "password": "hunter2hunter",
                                       "Authorization": "Bearer abcdef123456789", "token": "Hello",
                                       "max_tokens": 100},
                          "messages": [{"content": '{"password": "hunter2hunter"}'}]})
    text = json.dumps(out)
    for value in ("a8f3kd92jfl3", "hunter2hunter", "abcdef123456789"):
        assert value not in text
    assert out["metadata"]["token"] == "Hello" and out["metadata"]["max_tokens"] == 100
    assert out["metadata"]["Authorization"].startswith("Bearer REDACTED-bearer_token-")
    assert out["metadata"]["password"] in out["messages"][0]["content"]  # one value, one placeholder
    assert redactor.counts()["api_key"] == 3 and redactor.counts()["bearer_token"] == 1  # each counted once


def test_an_address_whose_local_part_is_not_ascii_is_replaced() -> None:
    out = LogRedactor().text("José@example.com, Zoë@example.org")
    assert "José" not in out and "Zoë" not in out and out.count("@x.invalid") == 2
