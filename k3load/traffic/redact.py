"""Secrets and personal data taken out of an agent's request log before `k3load import` writes a byte (issue 28).

    r = LogRedactor(extra_patterns=[r"cust-\\d{6}"])
    r.text("key sk-proj-4f9aXc... from bob@acme.io")   # 'key REDACTED-api_key-0001-qX7m... from u0001@x.invalid'
    r.value({"messages": [...]})                        # the same document, every string (and key) redacted
    r.counts()                                          # {"api_key": 1, "email": 1, ...}: numbers only, never values

Why patterns, not values (client/secret_forms.py knows the run's own key and finds it in any encoding): an
imported log holds other people's keys, addresses and numbers that nobody listed, so they are found by shape.

Placeholders are stable: the n-th distinct value of a kind gets number n (`REDACTED-api_key-0001`), the same
value the same placeholder everywhere in one import (a system prompt repeated in 50 requests stays byte-identical,
so prefix caching of the replayed traffic still works), and the same log imported twice gives the same files.
Never a hash of the value: a phone number's hash is brute-forced back in seconds. Each placeholder is as long as
the value where its marker fits (padded with FILLER, a fixed mix of letters and digits that tokenizes about like
a key), else the marker alone (at most MAX_GROWTH characters longer while a kind has under 10,000 distinct
values). It keeps the value's shape: an e-mail stays an address at the reserved `.invalid` domain
(`user0001...@example.invalid`, `u0001@x.invalid` when short), a phone number keeps its separators with digits
`5550...` (no such number is assigned), a private key keeps its BEGIN/END lines. It holds only letters, digits,
`-`, `@`, `.` and the phone's own separators: safe in JSON strings and YAML. A replacement never adds or removes
a quote or a backslash (only a whole private-key block loses its escaped `\\n`s), so escaped JSON inside a
string (a tool call's `arguments`, a JSON tool result) still parses. Text that already holds placeholders is
left as it is: redacting twice changes nothing (a fresh redactor too: it knows the marker, `.invalid` addresses
and `5550` phone digits).

What is matched (a match must start at a boundary: the text's start, a character that cannot continue the
token, or the end of a JSON escape such as `\\n`, `\\"` or `\\u201c`, so a key after an escaped newline is found):
- api_key: OpenAI `sk-...` (`sk-proj-`, `sk-svcacct-`; 20+ characters after `sk-`, holding a digit), Anthropic
  `sk-ant-...`, AWS access key ids `AKIA`/`ASIA` + 16, Stripe `sk_live_`/`rk_live_` (and `_test_`), GitHub
  `ghp_ gho_ ghu_ ghs_ ghr_` + 30+ and `github_pat_`, GitLab `glpat-`, Slack `xoxa- xoxb- xoxp- xoxr- xoxs-`,
  Google `AIza` + 35, Hugging Face `hf_` + 30+; and the value of an assignment `NAME = value` or `NAME: value`
  (quoted or not, inside escaped JSON too) whose name ends in api_key/apikey/api-key, access_key, secret_key,
  private_key, secret, token, password, passwd, passphrase or credential(s) (`aws_secret_access_key`,
  `GITHUB_TOKEN`, `"client_secret"`): a password's value when 4+ characters, any other when it has 8+ characters
  with a digit or 16+ without a space (so `"token": "Hello"` in a logprobs entry and `max_tokens: 100` stay);
- bearer_token: JWTs (`eyJ....eyJ....sig`), the credential after `Bearer ` (8+ characters with a digit, or 16+;
  the word Bearer stays), and an `Authorization` value (its scheme word stays);
- private_key: a PEM block `-----BEGIN ... PRIVATE KEY-----` to its END line, whole, with real or escaped
  (`\\n`, `\\\\n`) line breaks; a block cut off before its END line up to where its base64 stops;
- email: `local@domain.tld` (alphabetic TLD);
- phone: `+` and 8-15 digits with optional single separators (` `, `.`, `-`, parentheses: `+44 20 7946 0958`,
  `+1 (415) 555-0123`, `+14155550123`), North American `(415) 555-0123`, `415-555-0123`, `415.555.0123`,
  `1-415-555-0123`, and trunk-prefixed national numbers `020 7946 0958` (10-11 digits);
- pattern: each `--redact-pattern` (a Python regex): its group 1 when it has a capturing group that took part in
  the match (`customer=(\\d+)` replaces the digits, keeps `customer=`), else the whole match; use `(?:...)` to
  group without capturing. Patterns see the text as it stands (escaped JSON included): a pattern that matches a
  quote or a backslash removes it. Built-in kinds win where matches overlap; no pattern touches a placeholder.
What is not: ids, UUIDs, ISO dates and timestamps, version numbers, IP addresses, prices, plain digit runs with
no `+` or separators (a 12-digit order id), phone numbers with spaces only and no `+` or trunk 0
(`415 555 0123`), numbers in JSON number fields, percent-encoded or base64-wrapped secrets, keys of
unknown formats outside a named assignment, personal names and postal addresses. `git@github.com` and
`icon@2x.png` are replaced as addresses (harmless: no secret is lost by over-matching).

Cost: one compiled pattern per kind, each run only when the text holds its cheap marker (`@`, `PRIVATE KEY`,
a key prefix; found with `in`); matches are selected and replaced in Python, so cost follows the text's length
and its number of matches, not its characters. Measured on one core of the dev machine (10 MB synthetic, a
secret every 2 KB): 20 MB/s on digit-heavy text (prose, code, JSON rows of 12-digit ids) as one string, 16 MB/s
as 53,000 lines; 22 MB/s through `value` on a chat log (messages, tool-call arguments), 29 MB/s on the same
log as one JSON text. So 100 MB takes about 5 s. Phone numbers (every digit run is a candidate) cost most.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from typing import Any

from k3load.errors import InputError


class SecretKind(StrEnum):
    """The summary's keys: what kind of value was replaced."""

    API_KEY = "api_key"
    BEARER = "bearer_token"
    PRIVATE_KEY = "private_key"
    EMAIL = "email"
    PHONE = "phone"
    PATTERN = "pattern"


class RedactPatternError(InputError):
    """A --redact-pattern that does not compile, or matches the empty string (it would match everywhere)."""


# Pads a placeholder to its value's length: letters and digits mixed like a key's (so a tokenizer cuts it into
# about as many tokens), starting with a lowercase letter, no key prefix inside (AKIA, AIza, eyJ, hf_...).
FILLER = "qX7mK2pR9vT4wL8nB3cZ6hJ5dF1gS0yUeN4tQ8rW2kM7vP3xC9bH6jL5sD1fG0aZ"
MAX_GROWTH = 26  # the longest marker (`REDACTED-bearer_token-0001`): no placeholder outgrows its value by more

MIN_BUILT_IN = 6  # the shortest text a built-in kind matches (`a@b.io`)
Span = tuple[int, int, SecretKind | None]  # start, end, kind (None: a placeholder already there, kept)
_WORD = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
_EMAIL_WORD = _WORD | frozenset(".%+-")
_HEX = re.compile(r"[0-9A-Fa-f]{4}")
_DIGIT = re.compile(r"\d")
_DIGITS = re.compile(r"\d+")
_ESCAPE_LETTERS = frozenset("nrtbfu\"/\\")

_MARKER = re.compile(r"REDACTED-(?:" + "|".join(k.value for k in SecretKind) + r")-\d{4,}(?:-[A-Za-z0-9]*)?")
_PEM_BODY = r"(?:[A-Za-z0-9+/=\s:,.-]|\\+[nrt])"
_PEM = re.compile(r"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----(?:" + _PEM_BODY + r"*?-----END \1PRIVATE KEY-----|"
                  + _PEM_BODY + "*)")
# (prefix, pattern): each run only on a text holding its prefix, where re's literal-prefix search skips ahead
_KEY_FORMS = tuple((prefix, re.compile(source)) for prefix, source in (
    ("sk-", r"sk-[A-Za-z0-9_-]{20,}"),  # OpenAI sk-, sk-proj-, sk-svcacct-; Anthropic sk-ant-
    ("k_", r"[sr]k_(?:live|test)_[A-Za-z0-9]{10,}"),  # Stripe
    ("IA", r"A[KS]IA[A-Z0-9]{16}(?![A-Za-z0-9])"),  # AWS access key id
    ("gh", r"gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}"),
    ("glpat-", r"glpat-[A-Za-z0-9_-]{20,}"),
    ("xox", r"xox[abprs]-[A-Za-z0-9-]{10,}"),  # Slack
    ("AIza", r"AIza[A-Za-z0-9_-]{35}(?![A-Za-z0-9_-])"),  # Google
    ("hf_", r"hf_[A-Za-z0-9]{30,}"),  # Hugging Face
    ("eyJ", r"eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*"),  # JWT
))
_BEARER = re.compile(r"[Bb]earer[ \t]+([A-Za-z0-9._~+/-]+=*)")
_SCHEME = r"(?:(bearer|basic|token|digest)[ \t]+)?"
_ASSIGN = re.compile(
    r"(api[_-]?key|apikey|access[_-]?key|secret[_-]?key|private[_-]?key|secret|token|password|passwd|passphrase"
    r"|authorization|credentials?)(\\*[\"'])?[ \t]*[:=][ \t]*"
    r"(?:\\*[\"']" + _SCHEME + r"([^\"'\\\r\n]{1,512})|" + _SCHEME + r"([^\s\"'\\,;&<>(){}\[\]]{1,512}))")
_ASSIGN_ANY_CASE = re.compile(_ASSIGN.pattern, re.IGNORECASE)
# a JSON key naming a secret (`"client_secret": "..."` as an object member, not text): its string value is one
_SECRET_NAME = re.compile(r"(?:api[_-]?key|apikey|access[_-]?key|secret[_-]?key|private[_-]?key|secret|token|"
                          r"password|passwd|passphrase|authorization|credentials?)$", re.IGNORECASE)
_ASSIGN_GATE = ("key", "token", "secret", "passw", "passphrase", "authorization", "credential")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")  # a JSON number: never replaced by a bare placeholder
_NOT_VALUES = frozenset({"null", "none", "nil", "true", "false", "undefined", "redacted", "********"})
_EMAIL_DOMAIN = re.compile(r"@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,24}(?![A-Za-z0-9-])")
_EMAIL_LOCAL = re.compile(r"[\w.%+-]{1,64}\Z")  # a local part may hold any letter (José@...)
# The first character, then the boundary before it (a fixed-width look-behind: so re scans for `+`, `(` and
# digits alone, and a digit inside a run fails at once), then the forms, told apart by that first character.
_PHONE = re.compile(r"""[+(\d](?:(?<![A-Za-z0-9_.+\\-].)|(?<=\\[nrtbf].)|(?<=\\u[0-9A-Fa-f]{4}.))
    (?:(?<=\+)(?:\d{8,15}|\d{1,7}(?:(?:[ .-]|[ .-]?\(|\)[ .-]?)\d+)+\)?)    # E.164: +14155550123, +44 20 7946 0958
     | (?<=\()\d{3}\)[ ]?\d{3}[.-]\d{4}                                       # (415) 555-0123
     | (?<=1)[ .-](?:\(\d{3}\)[ ]?\d{3}[.-]\d{4}|\d{3}([.-])\d{3}\1\d{4})     # 1-415-555-0123
     | (?<=\d)\d{2}([.-])\d{3}\2\d{4}                                         # 415-555-0123, 415.555.0123
     | (?<=0)\d{2,4}[ -]\d{3,4}[ -]?\d{3,4}                                   # trunk 0: 020 7946 0958
    )(?![A-Za-z0-9_]|[.-]\d)""", re.VERBOSE)


def _start(text: str, s: int, word: frozenset[str] = _WORD) -> int | None:
    """Where a match found at `s` may start. Why: a key glued to a word (`risk-free`) is no key, but one after a
    JSON escape (`\\nsk-...`, `\\u201cAKIA...`) is. `s` itself at a boundary; `s` moved past the escape when `s`
    holds an escape's letter (the `n` of `\\nbob@x.io`: a replacement never eats half an escape); None when a
    word character before `s` ends no escape. Backslash runs of any length count as escaping (JSON inside JSON
    doubles them: `\\\\n`), which can only make a boundary of a place that is none: over-matching, never a leak."""
    if s == 0:
        return s
    prev = text[s - 1]
    if prev == "\\" and text[s] in _ESCAPE_LETTERS:
        return s + 5 if text[s] == "u" and _HEX.fullmatch(text, s + 1, s + 5) else s + 1
    if prev not in word:
        return s
    if (prev in "nrtbf" and s >= 2 and text[s - 2] == "\\") or \
            (s >= 6 and text[s - 6] == "\\" and text[s - 5] == "u" and _HEX.fullmatch(text, s - 4, s)):
        return s
    return None


def _at_boundary(text: str, s: int, word: frozenset[str] = _WORD) -> bool:
    return _start(text, s, word) == s


def _markers(text: str) -> Iterator[Span]:
    if "REDACTED-" in text:
        yield from ((m.start(), m.end(), None) for m in _MARKER.finditer(text))


def _private_keys(text: str) -> Iterator[Span]:
    if "PRIVATE KEY-----" in text:
        yield from ((m.start(), m.end(), SecretKind.PRIVATE_KEY) for m in _PEM.finditer(text))


def _keys(text: str) -> Iterator[Span]:
    for prefix, pattern in _KEY_FORMS:
        if prefix in text:
            for m in pattern.finditer(text):
                value = m.group()
                if _at_boundary(text, m.start()) and not (prefix == "sk-" and not _DIGIT.search(value)):
                    yield m.start(), m.end(), SecretKind.BEARER if prefix == "eyJ" else SecretKind.API_KEY


def _credential(value: str, password: bool) -> bool:
    """Whether an assigned or Bearer value looks like a credential, not a word (`"token": "Hello"`)."""
    if value.lower() in _NOT_VALUES or (not password and any(c.isspace() for c in value)):
        return False
    return len(value) >= 4 if password else len(value) >= 16 or (len(value) >= 8 and bool(_DIGIT.search(value)))


def _bearers(text: str) -> Iterator[Span]:
    if "earer" in text:
        for m in _BEARER.finditer(text):
            if _at_boundary(text, m.start()) and _credential(m.group(1), False):
                yield m.start(1), m.end(1), SecretKind.BEARER


def _assignments(text: str) -> Iterator[Span]:
    lowered = text.lower()
    if not any(g in lowered for g in _ASSIGN_GATE):
        return
    # the lowercase pattern on the lowercased text: 10 times faster than IGNORECASE (where lowercasing keeps
    # every index: a few characters, `İ`, lowercase to two)
    pattern, searched = (_ASSIGN, lowered) if len(lowered) == len(text) else (_ASSIGN_ANY_CASE, text)
    for m in pattern.finditer(searched):
        quoted = m.start(4) >= 0
        group = 4 if quoted else 6
        name, scheme = m.group(1).lower(), m.group(group - 1)
        start, end = m.span(group)
        value = text[start:end]
        if not quoted and m.group(2) and _NUMBER.fullmatch(value):
            continue  # `"token": 12345678`: a JSON number, that a placeholder would turn into invalid JSON
        if _credential(value, name.startswith("pass")):
            bearer = scheme is not None or name == "authorization"
            yield start, end, SecretKind.BEARER if bearer else SecretKind.API_KEY


def _emails(text: str) -> Iterator[Span]:
    if "@" not in text:
        return
    for m in _EMAIL_DOMAIN.finditer(text):
        at = m.start()
        local = _EMAIL_LOCAL.search(text, max(0, at - 64), at)
        start = None if local is None else _start(text, local.start(), _EMAIL_WORD)
        if start is not None and start < at:
            yield start, m.end(), None if m.group().lower().endswith(".invalid") else SecretKind.EMAIL


def _phones(text: str) -> Iterator[Span]:
    for m in _PHONE.finditer(text):
        digits, end = 0, m.start()
        for group in _DIGITS.finditer(text, m.start(), m.end()):  # an E.164 run cut to 15 digits, group by group
            if digits + len(group.group()) > 15:
                break
            digits, end = digits + len(group.group()), group.end()
        trunk = m.group().startswith("0")
        if digits >= 8 and (m.group().startswith("+") or end == m.end()) and (not trunk or 10 <= digits <= 11):
            if text.startswith(")", end) and "(" in text[m.start():end]:
                end += 1
            placeholder = "".join(_DIGITS.findall(text, m.start(), end)).startswith("5550")
            yield m.start(), end, None if placeholder else SecretKind.PHONE


_BUILT_IN: tuple[Callable[[str], Iterator[Span]], ...] = (
    _markers, _private_keys, _keys, _bearers, _assignments, _emails, _phones)


def _compile_pattern(source: str) -> re.Pattern[str]:
    try:
        pattern = re.compile(source)
    except re.error as exc:
        raise RedactPatternError(f"--redact-pattern {source!r} is not a valid regular expression: {exc}") from exc
    if pattern.search("") is not None:
        raise RedactPatternError(f"--redact-pattern {source!r} matches the empty string (it would match anywhere)")
    return pattern


def _pattern_finder(pattern: re.Pattern[str]) -> Callable[[str], Iterator[Span]]:
    def find(text: str) -> Iterator[Span]:
        for m in pattern.finditer(text):
            group = 1 if pattern.groups and m.start(1) >= 0 else 0
            yield m.start(group), m.end(group), SecretKind.PATTERN
    return find


def _pad(head: str, tail: str, length: int, filler: str = "-" + FILLER) -> str:
    """`head` + filler + `tail`, `length` long where that fits (else `head` + `tail`)."""
    room = length - len(head) - len(tail)
    return head + (filler * (room // len(filler) + 1))[:max(room, 0)] + tail


def _placeholder(kind: SecretKind, n: int, value: str) -> str:
    """The n-th distinct value of `kind` as a placeholder of `value`'s shape and (where it fits) length."""
    if kind is SecretKind.EMAIL:
        local, domain = (f"user{n:04d}", "@example.invalid") if len(value) >= 24 else (f"u{n:04d}", "@x.invalid")
        return _pad(local, domain, len(value), FILLER)
    if kind is SecretKind.PHONE:
        count = sum(c.isdigit() for c in value)
        digits = iter("5550" + str(n).zfill(count - 4))
        return "".join(next(digits, "") if c.isdigit() else c for c in value) + "".join(digits)
    marker = f"REDACTED-{kind.value}-{n:04d}"
    if kind is SecretKind.PRIVATE_KEY:
        label = value[len("-----BEGIN "):value.index("PRIVATE KEY-----")]
        end = f"-----END {label}PRIVATE KEY-----" if "-----END " in value else ""  # a block cut off stays cut off
        return _pad(f"-----BEGIN {label}PRIVATE KEY-----{marker}", end, len(value))
    return _pad(marker, "", len(value))


class LogRedactor:
    """Replaces secrets and personal data (see the module's docstring) by stable placeholders, one import's worth:
    one instance per import, so numbering and the same-value-same-placeholder promise span all its files."""

    def __init__(self, extra_patterns: Sequence[str] = ()) -> None:
        self._finders = (*_BUILT_IN, *(_pattern_finder(_compile_pattern(p)) for p in extra_patterns))
        self._placeholders: dict[str, str] = {}  # value -> its placeholder (in memory only, never written)
        self._numbered = dict.fromkeys(SecretKind, 0)
        self._counts = dict.fromkeys(SecretKind, 0)
        self._seen: dict[SecretKind, set[str]] = {k: set() for k in SecretKind}

    def text(self, value: str) -> str:
        """`value` with every secret replaced (the same string when it holds none)."""
        if len(value) < MIN_BUILT_IN and len(self._finders) == len(_BUILT_IN):
            return value  # `"role": "user"`: most strings of a log, and too short for any built-in kind
        parts, pos = [], 0
        for start, end, kind in self._spans(value):
            if kind is not None:
                parts += [value[pos:start], self._replace(kind, value[start:end])]
                pos = end
        if not parts:
            return value
        parts.append(value[pos:])
        return "".join(parts)

    def value(self, obj: Any, key: str | None = None) -> Any:
        """A new JSON value: strings redacted, dict keys too, in their order; numbers, bools and None as they are.
        A string that is the value of a member whose name says it holds a secret (`"client_secret": "a8f3..."`,
        `"password": "..."`, `"Authorization": "Bearer ..."`) is one, as the same text in a string would be."""
        if isinstance(obj, str):
            redacted = self.text(obj)
            if redacted == obj and key is not None and _SECRET_NAME.search(key) and not _MARKER.fullmatch(obj):
                return self._named(key, obj)
            return redacted
        if isinstance(obj, dict):
            return {self.text(k) if isinstance(k, str) else k: self.value(v, k if isinstance(k, str) else None)
                    for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self.value(v) for v in obj]
        return obj

    def _named(self, key: str, value: str) -> str:
        """The value of a secret-named member: the credential after an authentication scheme, else the whole."""
        scheme, _, credential = value.partition(" ")
        if credential and scheme.lower() in ("bearer", "basic", "token", "digest") and \
                _credential(credential, False):
            return f"{scheme} {self._replace(SecretKind.BEARER, credential)}"
        if _credential(value, key.lower().startswith("pass")):
            kind = SecretKind.BEARER if key.lower() == "authorization" else SecretKind.API_KEY
            return self._replace(kind, value)
        return value

    def counts(self) -> dict[str, int]:
        """Occurrences replaced so far, per kind (every kind, 0 included): the summary, never a value."""
        return {k.value: n for k, n in self._counts.items()}

    def distinct(self) -> dict[str, int]:
        """Distinct values replaced so far, per kind."""
        return {k.value: len(seen) for k, seen in self._seen.items()}

    def _replace(self, kind: SecretKind, secret: str) -> str:
        self._counts[kind] += 1
        self._seen[kind].add(secret)
        placeholder = self._placeholders.get(secret)
        if placeholder is None:  # numbered on first sight: the same log in the same order, the same numbers
            self._numbered[kind] += 1
            placeholder = self._placeholders[secret] = _placeholder(kind, self._numbered[kind], secret)
        return placeholder

    def _spans(self, text: str) -> list[Span]:
        """The spans to keep or replace, in text order, none overlapping: placeholders already there first, then
        each finder in turn (built-in kinds before --redact-pattern ones) where it overlaps nothing taken."""
        found = [(-1 if kind is None else rank, start, end, kind)
                 for rank, find in enumerate(self._finders) for start, end, kind in find(text) if end > start]
        if not found:
            return []
        found.sort(key=lambda f: (f[0], f[1]))
        starts: list[int] = []
        taken: list[Span] = []
        for _, start, end, kind in found:
            i = bisect.bisect_right(starts, start)
            if (i and taken[i - 1][1] > start) or (i < len(taken) and taken[i][0] < end):
                continue
            starts.insert(i, start)
            taken.insert(i, (start, end, kind))
        return taken
