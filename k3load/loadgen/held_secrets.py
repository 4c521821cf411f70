"""The run's secrets (the API key, gateway headers), held in this process and out of Locust's options.

    hold(parsed, host)        at `init`, every role: the key and headers move out of the parsed options into
                              this process's holder, bound to the target's origin given at start; on a master
                              or local runner the options get `k3_secrets_check` instead
    held()                    what `k3load.loadgen.options.run_access` sends (the parsed options win where a
                              caller built them itself, as tests do)
    worker_problem(...)       a worker, at each test start: None, or why it refuses (one line, no value)

Why out of the options: Locust relays every option to each worker in its `spawn` message (runners.py,
`"parsed_options": vars(...)`) over ZeroMQ without authentication, and every process re-reads them at each
test start. A worker reads its secrets from its own environment (`K3_API_KEY`, `K3_HEADER`: a Kubernetes
Secret mounted into its pod), never from the master. What travels is a check: a salted PBKDF2-SHA256 over the
target's origin and the secrets, so a worker can tell it holds the same secrets for the same target. A slow,
salted hash, because a plain SHA-256 prefix of a short key is a guess away from the key itself for whoever
reads the worker port.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from typing import Any

from k3load.client.access import header_lines
from k3load.client.origin import key_origin as origin

ROUNDS = 100_000  # ~0.1 s once per process start and per test start on a worker
SCHEME = "pbkdf2-sha256"


@dataclass(frozen=True)
class Held:
    api_key: str = ""
    headers: tuple[str, ...] = ()
    origin: str = ""  # scheme://host:port of the target at start: the only place the secrets go

    def __bool__(self) -> bool:
        return bool(self.api_key or self.headers)


_HELD = Held()
_OWNER: Any = None  # the parsed options they were taken from


def hold(parsed: Any, host: str | None) -> Held:
    """Move the secrets out of `parsed` into this process's holder (what an earlier `init` held is replaced),
    and put the check the workers verify in their place."""
    global _HELD, _OWNER
    _HELD = Held(getattr(parsed, "k3_api_key", "") or "", tuple(getattr(parsed, "k3_header", None) or ()),
                 origin(host))
    _OWNER = parsed
    if hasattr(parsed, "k3_api_key"):
        parsed.k3_api_key = ""
    if hasattr(parsed, "k3_header"):
        parsed.k3_header = []
    if hasattr(parsed, "k3_secrets_check"):
        parsed.k3_secrets_check = check_token(_HELD, _HELD.origin)
    return _HELD


def held(parsed: Any = None) -> Held:
    """What is held; given options, only if they are the ones it was taken from (a test process builds many)."""
    if parsed is not None and parsed is not _OWNER:
        return Held()
    return _HELD


def release() -> None:
    """Forget what is held."""
    global _HELD, _OWNER
    _HELD, _OWNER = Held(), None


def check_token(secrets: Held, target_origin: str, salt: bytes | None = None) -> str:
    """"" without secrets, else `pbkdf2-sha256$ROUNDS$SALT$DIGEST` (hex; the digest cut to 128 bits)."""
    if not secrets:
        return ""
    salt = os.urandom(16) if salt is None else salt
    return f"{SCHEME}${ROUNDS}${salt.hex()}${_digest(secrets, target_origin, salt, ROUNDS)}"


def _digest(secrets: Held, target_origin: str, salt: bytes, rounds: int) -> str:
    material = json.dumps([target_origin, secrets.api_key, header_lines(secrets.headers)]).encode()
    return hashlib.pbkdf2_hmac("sha256", material, salt, rounds).hex()[:32]


def worker_problem(token: str, secrets: Held, target: str | None) -> str | None:
    """Why this worker must not send a request for the master's run, or None. Never says a value."""
    if not token:
        return None if not secrets else ("this worker has K3_API_KEY or K3_HEADER set, and the master sends no key "
                                         "or header: unset them here, or give the master the same ones")
    if not secrets:
        return ("the master's target needs an API key or gateway headers and this worker has none: set K3_API_KEY "
                "(and K3_HEADER) in its environment, from the same Secret as the master's")
    try:
        scheme, rounds, salt, digest = token.split("$")
        same = scheme == SCHEME and hmac.compare_digest(digest, _digest(secrets, origin(target),
                                                                        bytes.fromhex(salt), int(rounds)))
    except ValueError:
        return "the master's secrets check is not one this worker can read: run the same k3load version on both"
    if not same:
        return ("this worker's K3_API_KEY / K3_HEADER differ from the master's, or its target is another: give "
                "both the same Secret")
    if secrets.origin and secrets.origin != origin(target):
        return f"this worker was started for {secrets.origin} and the master sends its load to {origin(target)}"
    return None
