"""The OpenSSH client's `ssh-keygen -Y` (sign, check, find-principals, verify), run for the record's signatures.

Why ssh-keygen and not a crypto library: every engineer already has an ed25519 or RSA key and an agent, git
signs commits the same way (`gpg.format ssh`), and the allowed-signers file is OpenSSH's own format; no new
dependency comes in. Every call runs without a terminal (its own session, stdin closed or fed, no askpass),
so a passphrase prompt can never hang a run or CI: a protected key without an agent is said, in one line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

NAMESPACE = "k3load"  # what a signature is for (ssh-keygen -n): a k3load record, never a git commit or a file
TIMEOUT_S = 30.0
PUBLIC_KEY_PREFIXES = ("ssh-", "ecdsa-", "sk-ssh-", "sk-ecdsa-")


class SigningError(Exception):
    """Signing or checking could not be done (no ssh-keygen, an unusable key): one line saying why."""


@dataclass(frozen=True)
class SigningKey:
    """The key `-f` is given: a private key file, or a public key whose private half an agent holds."""

    path: Path
    public_key: str  # "type base64"
    comment: str
    via_agent: bool


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "SSH_ASKPASS", "SSH_ASKPASS_REQUIRE")}


def _run(args: list[str], data: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    tool = shutil.which(args[0])
    if tool is None:
        raise SigningError(f"{args[0]} not found: install OpenSSH's client (Debian: apt install openssh-client)")
    try:
        return subprocess.run([tool, *args[1:]], input=data if data is not None else b"", capture_output=True,
                              timeout=TIMEOUT_S, env=_env(), start_new_session=True, check=False)
    except subprocess.TimeoutExpired:
        raise SigningError(f"{' '.join(args[:3])}: no answer in {TIMEOUT_S:.0f} s") from None
    except OSError as exc:
        raise SigningError(f"{args[0]}: cannot run it ({exc.strerror or exc})") from None


def _said(result: subprocess.CompletedProcess[bytes]) -> str:
    return " ".join(result.stderr.decode(errors="replace").split())[:300]


def _agent_keys() -> set[str]:
    """The agent's keys as "type base64" (empty: no agent, or it holds none)."""
    if not os.environ.get("SSH_AUTH_SOCK"):
        return set()
    try:
        listed = _run(["ssh-add", "-L"])
    except SigningError:
        return set()
    return {" ".join(line.split()[:2]) for line in listed.stdout.decode(errors="replace").splitlines()
            if line.startswith(PUBLIC_KEY_PREFIXES)}


def _public_line(text: str) -> tuple[str, str]:
    parts = text.strip().split(None, 2)
    return " ".join(parts[:2]), parts[2] if len(parts) > 2 else ""


def signing_key(path: Path) -> SigningKey:
    """The key at `path`, ready to sign: an unprotected private key, or one (or its public half) an agent
    holds. Unreadable, not a key, or protected with no agent holding it: a SigningError saying which."""
    try:
        head = path.read_bytes()[:4096].decode(errors="replace")
    except OSError as exc:
        raise SigningError(f"--key {path}: cannot read it ({exc.strerror or exc})") from None
    pub = path if head.startswith(PUBLIC_KEY_PREFIXES) else path.with_name(path.name + ".pub")
    if pub == path:
        public, comment = _public_line(head)
        if public in _agent_keys():
            return SigningKey(path, public, comment, True)
        raise SigningError(f"--key {path}: a public key, and no ssh-agent holds its private half")
    derived = _run(["ssh-keygen", "-y", "-P", "", "-f", str(path)])
    if derived.returncode == 0:
        public, comment = _public_line(derived.stdout.decode(errors="replace"))
        if not comment and pub.is_file():
            comment = _public_line(pub.read_text(errors="replace"))[1]
        return SigningKey(path, public, comment, False)
    if pub.is_file():
        public, comment = _public_line(pub.read_text(errors="replace"))
        if public in _agent_keys():
            return SigningKey(pub, public, comment, True)
    raise SigningError(f"--key {path}: passphrase-protected (or not a private key: {_said(derived)}) and no "
                       "ssh-agent holds it: add it with ssh-add, or give an unprotected key")


def sign(data: bytes, key: SigningKey) -> str:
    """The armored signature of `data` under NAMESPACE."""
    with tempfile.TemporaryDirectory(prefix="k3load-sign-") as folder:
        target = Path(folder) / "manifest.sha256"
        target.write_bytes(data)
        done = _run(["ssh-keygen", "-Y", "sign", "-n", NAMESPACE, "-f", str(key.path), "-q", str(target)])
        signature = target.with_name(target.name + ".sig")
        if done.returncode != 0 or not signature.is_file():
            raise SigningError(f"ssh-keygen -Y sign failed: {_said(done) or f'exit {done.returncode}'}")
        return signature.read_text()


def _with_block(block: str, run: Callable[[str], subprocess.CompletedProcess[bytes]]
                ) -> subprocess.CompletedProcess[bytes]:
    with tempfile.TemporaryDirectory(prefix="k3load-verify-") as folder:
        path = Path(folder) / "signature.sig"
        path.write_text(block)
        return run(str(path))


def matches(block: str, data: bytes) -> bool:
    """Whether the signature is over `data` under NAMESPACE, by the key it carries (no signer checked)."""
    done = _with_block(block, lambda sig: _run(["ssh-keygen", "-Y", "check-novalidate", "-n", NAMESPACE, "-s", sig],
                                               data))
    return done.returncode == 0


def principals(block: str, allowed: Path) -> list[str]:
    """The allowed-signers principals whose key made the signature (empty: none)."""
    done = _with_block(block, lambda sig: _run(["ssh-keygen", "-Y", "find-principals", "-s", sig, "-f",
                                                str(allowed)]))
    return done.stdout.decode(errors="replace").split() if done.returncode == 0 else []


def verify(block: str, data: bytes, allowed: Path, principal: str) -> tuple[bool, str]:
    """(ok, what ssh-keygen said) for the signature over `data` by `principal` of the allowed-signers file."""
    done = _with_block(block, lambda sig: _run(["ssh-keygen", "-Y", "verify", "-f", str(allowed), "-I", principal,
                                                "-n", NAMESPACE, "-s", sig], data))
    said = " ".join((done.stdout + done.stderr).decode(errors="replace").split())[:300]
    return done.returncode == 0, said
