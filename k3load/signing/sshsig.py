"""OpenSSH signatures (`ssh-keygen -Y sign`) read: each armored block of a file, its key and its fingerprint.

    blocks = split_armored(text)                 # every "-----BEGIN SSH SIGNATURE-----" block, in order
    info = read_block(blocks[0])                 # SignatureInfo(namespace, key_type, fingerprint, ...)

Why parse at all when ssh-keygen verifies: a signature that does not verify must still say whose key made it
("signed by SHA256:… , not in the allowed signers"), and several signers' blocks share one file
(`manifest.sha256.sig`), which ssh-keygen reads one block at a time. The format is OpenSSH's PROTOCOL.sshsig:
the armored base64 of `"SSHSIG" | uint32 version | string publickey | string namespace | string reserved |
string hash_algorithm | string signature`, each string a uint32 length and its bytes; the fingerprint is
OpenSSH's `SHA256:` and the unpadded base64 of the public key blob's SHA-256 (what `ssh-keygen -l` prints).
A block that is not that is a `SignatureFormatError` naming what is wrong, never an exception of another kind.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
from dataclasses import dataclass

from k3load.errors import InputError

BEGIN, END = "-----BEGIN SSH SIGNATURE-----", "-----END SSH SIGNATURE-----"
_BLOCK = re.compile(re.escape(BEGIN) + r"\s*(.*?)\s*" + re.escape(END), re.DOTALL)
MAGIC = b"SSHSIG"
MAX_BLOCK_CHARS = 64 * 1024  # an RSA-16384 signature is under 5 KB armored: more is not a signature


class SignatureFormatError(InputError):
    """A block that is no OpenSSH signature: the message says what is wrong."""


@dataclass(frozen=True)
class SignatureInfo:
    namespace: str
    key_type: str  # the public key's algorithm name (ssh-ed25519, ssh-rsa, ...)
    fingerprint: str  # SHA256:... as ssh-keygen -l prints it
    hash_algorithm: str


def split_armored(text: str) -> list[str]:
    """Every armored block of `text`, each with its BEGIN and END lines, in file order."""
    return [f"{BEGIN}\n{m.group(1)}\n{END}\n" for m in _BLOCK.finditer(text)]


def fingerprint(key_blob: bytes) -> str:
    return "SHA256:" + base64.b64encode(hashlib.sha256(key_blob).digest()).decode().rstrip("=")


def _strings(data: bytes, offset: int, count: int) -> tuple[list[bytes], int]:
    out = []
    for _ in range(count):
        if offset + 4 > len(data):
            raise SignatureFormatError("cut short")
        (length,) = struct.unpack(">I", data[offset:offset + 4])
        offset += 4
        if length > len(data) - offset:
            raise SignatureFormatError("a field runs past the end")
        out.append(data[offset:offset + length])
        offset += length
    return out, offset


def read_block(block: str) -> SignatureInfo:
    """The signature's namespace, key and hash algorithm (not whether it verifies: ssh-keygen says that)."""
    match = _BLOCK.search(block)
    if match is None:
        raise SignatureFormatError("no SSH SIGNATURE block")
    body = "".join(match.group(1).split())
    if len(body) > MAX_BLOCK_CHARS:
        raise SignatureFormatError(f"{len(body):,} characters: too long for a signature")
    try:
        data = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureFormatError("not base64") from None
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise SignatureFormatError("not an SSHSIG signature (no SSHSIG magic)")
    (version,) = struct.unpack(">I", data[len(MAGIC):len(MAGIC) + 4])
    if version != 1:
        raise SignatureFormatError(f"SSHSIG version {version}, not 1")
    (key, namespace, _reserved, hash_algorithm, _signature), _ = _strings(data, len(MAGIC) + 4, 5)
    (key_type,), _ = _strings(key, 0, 1)
    try:
        return SignatureInfo(namespace.decode(), key_type.decode(), fingerprint(key), hash_algorithm.decode())
    except UnicodeDecodeError:
        raise SignatureFormatError("a name that is not UTF-8") from None
