"""Whether a secret can be read back from a text, in any form a server may echo it: the check the secret
tests hold every file of a run to, written apart from the redactor (k3load.client.secret_forms): it decodes
the text (JSON escapes, again and again; percent-encoding; base64) instead of matching encodings.

    leaks(text, "sk-k3-SECRET-4f9a2c")     # True for '\\u0073k-k3-SECRET-4f9a2c', 'c2stazMt...', 'sk%2Dk3...'
    encodings("sk-k3-SECRET-4f9a2c")       # the key in each form, as the echo server sends it
"""

from __future__ import annotations

import base64
import contextlib
import re
from urllib.parse import quote, quote_plus, unquote, unquote_plus

_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_=-]{8,4096}")
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|[\\/\"])")


def json_unescape(text: str) -> str:
    """JSON string escapes undone, again and again (JSON inside JSON) until nothing changes."""
    for _ in range(5):
        done = _ESCAPE.sub(lambda m: chr(int(m.group(1)[1:], 16)) if m.group(1)[0] == "u" else m.group(1), text)
        if done == text:
            break
        text = done
    return text


def base64_decodings(text: str) -> list[bytes]:
    """Every run of base64 characters (up to 4 KB) decoded from each of its first four places, in both
    alphabets."""
    out = []
    for run in _BASE64_RUN.findall(text):
        for start in range(4):
            piece = run[start:].rstrip("=")
            piece = piece[: len(piece) - 1] if len(piece) % 4 == 1 else piece + "=" * (-len(piece) % 4)
            for alt in (b"+/", b"-_"):
                with contextlib.suppress(ValueError):
                    out.append(base64.b64decode(piece.encode(), altchars=alt))
    return out


def leaks(text: str, secret: str) -> bool:
    """Whether `secret` can be read back from `text`: as it is, JSON-unescaped, percent-decoded (either
    or both), or base64-decoded."""
    if secret in text:
        return True
    unescaped = json_unescape(text)
    texts = (unescaped, unquote(text), unquote_plus(text), unquote_plus(unescaped), json_unescape(unquote(text)))
    return any(secret in t for t in texts) or any(secret.encode() in raw for raw in base64_decodings(text))


def encodings(secret: str) -> dict[str, str]:
    """`secret` as a server may echo it, one form per name."""
    return {"json_all": "".join(f"\\u{ord(c):04x}" for c in secret),
            "json_mixed": "".join(f"\\u{ord(c):04X}" if i % 2 else c for i, c in enumerate(secret)),
            "json_in_json": "".join(f"\\\\u{ord(c):04x}" for c in secret),
            "percent": quote(secret, safe=""),
            "percent_mixed": "".join(f"%{ord(c):02x}" if i % 3 == 0 else c for i, c in enumerate(secret)),
            "form": quote_plus(secret),
            "basic": base64.b64encode(f"probe:{secret}".encode()).decode(),
            "base64": base64.b64encode(secret.encode()).decode()}
