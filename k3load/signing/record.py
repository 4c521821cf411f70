"""A run's signatures: `manifest.sha256.sig` (every signer's OpenSSH signature block, in signing order) and
`manifest.sha256.signers.json` (who each one claims to be, the key's fingerprint, when, and over which manifest).

    add_signature(run_dir, signing_key(Path("~/.ssh/id_ed25519")), identity=None)
    checks = check_signatures(run_dir, allowed=Path("allowed_signers"))

Why beside the manifest and outside it: the manifest covers every evidence file, and a signature covers the
manifest (its exact bytes), so no evidence file can change, with its manifest line recomputed or not, without
the signature failing. Both files start with `manifest.sha256`, which the manifest never lists
(analysis/outputs/manifest.py), so a second signer adds a signature without changing what the first one signed.

What a signature proves comes from ssh-keygen, not from the metadata: the metadata's identity and time are the
signer's claims, shown as such; `check_signatures` names the signer from the allowed-signers file
(`ssh-keygen -Y find-principals`) and verifies it (`-Y verify`). Without an allowed-signers file it can only
say whether each signature matches the manifest by the key it carries, and says that the signers were not
checked.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

from k3load.analysis.outputs import report_signers
from k3load.analysis.outputs.manifest import MANIFEST as MANIFEST  # read as record.MANIFEST by the CLIs
from k3load.rundir import write_atomic
from k3load.signing import keygen, sshsig

SIGNATURES = MANIFEST + ".sig"
SIGNERS = MANIFEST + ".signers.json"
STALE = MANIFEST + ".stale"  # signatures over an earlier manifest, each set with the manifest it signed
# a signer's name as the reports can hold it: no markup, table cell or code delimiters, no control characters
_PRINCIPAL = re.compile(r"[^\s<>|`\x00-\x1f\x7f]([^<>|`\x00-\x1f\x7f]{0,198}[^\s<>|`\x00-\x1f\x7f])?")


@dataclass(frozen=True)
class Signer:
    """One signature's claims (what the signer said when signing), in signing order."""

    identity: str
    fingerprint: str
    key_type: str
    signed_at: str  # ISO 8601, UTC, as the signer's clock said
    manifest_sha256: str  # the manifest's bytes it signed


class SignatureStatus(StrEnum):
    """What one signature's check found."""

    OK = "ok"  # over this manifest, by an allowed signer's key, verified as that principal
    UNCHECKED = "unchecked"  # over this manifest by the key it carries; no allowed-signers file was given
    MISMATCH = "mismatch"  # not over this manifest (or not in the k3load namespace)
    NOT_ALLOWED = "not_allowed"  # its key is in no allowed signer's line
    BAD = "bad"  # an allowed signer's key, yet it does not verify as that principal
    UNREADABLE = "unreadable"  # not an OpenSSH signature


WORDS = {SignatureStatus.OK: "good",
         SignatureStatus.UNCHECKED: "matches the manifest; its signer was not checked (no --allowed-signers)",
         SignatureStatus.MISMATCH: "does not match", SignatureStatus.NOT_ALLOWED: "signer not allowed",
         SignatureStatus.BAD: "does not verify", SignatureStatus.UNREADABLE: "unreadable"}


@dataclass(frozen=True)
class SignatureCheck:
    """One signature, checked (`status`: SignatureStatus)."""

    index: int
    status: SignatureStatus
    fingerprint: str | None
    claimed: str | None  # the identity the signer gave
    principals: tuple[str, ...] = ()  # who the allowed-signers file says it is
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in (SignatureStatus.OK, SignatureStatus.UNCHECKED)


def manifest_bytes(run_dir: Path) -> bytes:
    try:
        return (run_dir / MANIFEST).read_bytes()
    except OSError as exc:
        raise keygen.SigningError(f"{run_dir}: no {MANIFEST} ({exc.strerror or exc}): judge the run first "
                                  "(k3load analyze)") from None


def read_signers(run_dir: Path) -> list[Signer]:
    try:
        data = json.loads((run_dir / SIGNERS).read_text())
        return [Signer(**{k: str(row.get(k, "")) for k in Signer.__dataclass_fields__}) for row in data["signers"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def read_blocks(run_dir: Path) -> list[str]:
    try:
        return sshsig.split_armored((run_dir / SIGNATURES).read_text(errors="replace"))
    except OSError:
        return []


def add_signature(run_dir: Path, key: keygen.SigningKey, identity: str | None) -> Signer:
    """Sign the run's manifest as it is now and keep the signature beside the earlier ones."""
    data = manifest_bytes(run_dir)
    who = identity or key.comment
    if not who:
        raise keygen.SigningError(f"--key {key.path}: its public key has no comment to name the signer: give "
                                  "--identity (the principal of the allowed-signers file, e.g. lead@example.com)")
    if not _PRINCIPAL.fullmatch(who):
        raise keygen.SigningError(f"identity {who[:80]!r}: a principal is printable text without <, >, |, a "
                                  "backtick or a line end (it is written into the reports)")
    block = keygen.sign(data, key)
    info = sshsig.read_block(block)
    if not keygen.matches(block, data):
        raise keygen.SigningError("ssh-keygen made a signature that does not check against the manifest")
    signer = Signer(who, info.fingerprint, info.key_type,
                    time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), hashlib.sha256(data).hexdigest())
    blocks, signers = read_blocks(run_dir), read_signers(run_dir)
    try:
        write_atomic(run_dir / SIGNERS, json.dumps({"signers": [asdict(s) for s in [*signers, signer]]},
                                                   indent=2) + "\n")
        write_atomic(run_dir / SIGNATURES, "".join([*blocks, block]))
    except OSError as exc:  # a full disk: the signers file back as it was, so the two still agree
        write_atomic(run_dir / SIGNERS, json.dumps({"signers": [asdict(s) for s in signers]}, indent=2) + "\n")
        raise keygen.SigningError(f"{run_dir}: cannot write the signature ({exc.strerror or exc})") from None
    refresh_reports(run_dir)
    return signer


def _judge(run_dir: Path) -> str:
    try:
        return str((json.loads((run_dir / "run.json").read_text()).get("options") or {}).get("k3_judge") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def refresh_reports(run_dir: Path) -> None:
    """The reports' signer regions say who signed now (their content is outside what the manifest hashes)."""
    expected = report_signers.expected(read_signers(run_dir), _judge(run_dir))
    for name in report_signers.REPORTS:
        path = run_dir / name
        if path.is_file():
            text = path.read_text()
            filled = report_signers.with_regions(text, expected[name])
            if filled != text:
                write_atomic(path, filled)


def consistency_problems(run_dir: Path) -> list[str]:
    """What does not hold together: the signers file against the signatures (one entry per block, each with
    the block's key), and the reports' signer regions against the signers file."""
    blocks, signers = read_blocks(run_dir), read_signers(run_dir)
    problems = []
    if len(signers) != len(blocks):
        problems.append(f"{SIGNERS}: {len(signers)} signer(s) for {len(blocks)} signature(s)")
    for index, (block, signer) in enumerate(zip(blocks, signers, strict=False)):
        try:
            key = sshsig.read_block(block).fingerprint
        except sshsig.SignatureFormatError:
            continue  # said by the signature's own check
        if key != signer.fingerprint:
            problems.append(f"{SIGNERS}: signer {index + 1} says key {signer.fingerprint}, its signature was made "
                            f"with {key}")
    expected = report_signers.expected(signers, _judge(run_dir))
    for name in report_signers.REPORTS:
        path = run_dir / name
        text = path.read_text(errors="replace") if path.is_file() else ""
        found = report_signers.region_contents(text)
        extra = {name: n for name, n in report_signers.region_counts(text).items() if n > 1}
        if extra:
            problems.append(f"{name}: {', '.join(f'{n} {r} regions' for r, n in extra.items())} where k3load writes "
                            "one (marker text in the evidence would leave content unhashed)")
        for region, content in found.items():
            if content != expected[name].get(region):
                problems.append(f"{name}: its {'signer table' if region == 'signers' else 'judge line'} does not "
                                f"say who signed ({SIGNERS} and the signatures do)")
    return problems


def check_signatures(run_dir: Path, allowed: Path | None) -> list[SignatureCheck]:
    """Every signature of the run against its manifest as it is now (and the allowed signers, when given)."""
    data = manifest_bytes(run_dir)
    signers = read_signers(run_dir)
    out = []
    for index, block in enumerate(read_blocks(run_dir)):
        claimed = signers[index].identity if index < len(signers) else None
        out.append(_check(index, block, data, allowed, claimed))
    return out


def _check(index: int, block: str, data: bytes, allowed: Path | None, claimed: str | None) -> SignatureCheck:
    try:
        info = sshsig.read_block(block)
    except sshsig.SignatureFormatError as exc:
        return SignatureCheck(index, SignatureStatus.UNREADABLE, None, claimed, detail=str(exc))
    if info.namespace != keygen.NAMESPACE or not keygen.matches(block, data):
        said = f"namespace {info.namespace!r}" if info.namespace != keygen.NAMESPACE else \
            "not over this manifest.sha256 (an evidence file or the manifest changed after it was signed)"
        return SignatureCheck(index, SignatureStatus.MISMATCH, info.fingerprint, claimed, detail=said)
    if allowed is None:
        return SignatureCheck(index, SignatureStatus.UNCHECKED, info.fingerprint, claimed)
    found = tuple(keygen.principals(block, allowed))
    if not found:
        return SignatureCheck(index, SignatureStatus.NOT_ALLOWED, info.fingerprint, claimed,
                              detail=f"its key {info.fingerprint} is no allowed signer's in {allowed}")
    results = [keygen.verify(block, data, allowed, p) for p in found]
    if not any(ok for ok, _ in results):
        return SignatureCheck(index, SignatureStatus.BAD, info.fingerprint, claimed, found, results[0][1])
    return SignatureCheck(index, SignatureStatus.OK, info.fingerprint, claimed, found)


def set_aside_stale(run_dir: Path, signed: bytes | None) -> Path | None:
    """After a re-judging rewrote the manifest: the signatures over the earlier one (`signed`) no longer cover
    the run. Never dropped: moved with that manifest into manifest.sha256.stale/K/, where `k3load verify` names
    them and they still verify against what they signed. None when there were none, or the new manifest is
    byte for byte the one they signed (judging is deterministic: the same evidence, the same manifest)."""
    if signed is None or not read_blocks(run_dir) or manifest_bytes(run_dir) == signed:
        return None
    stale = run_dir / STALE
    number = 1 + max((int(p.name) for p in stale.glob("*") if p.name.isdigit()), default=0)
    folder = stale / str(number)
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_bytes(signed)
    for name in (SIGNATURES, SIGNERS):
        if (run_dir / name).exists():
            (run_dir / name).replace(folder / name)
    return folder


def stale_sets(run_dir: Path) -> list[tuple[Path, list[Signer]]]:
    """Each set of stale signatures (folder, its signers' claims), oldest first."""
    stale = run_dir / STALE
    folders = sorted((p for p in stale.glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
    return [(folder, read_signers(folder)) for folder in folders]


def describe(check: SignatureCheck) -> str:
    """One line per signature, for `k3load verify`."""
    who = ", ".join(check.principals) or (f"claims {check.claimed}" if check.claimed else "no claimed signer")
    head = f"signature {check.index + 1} ({who}; {check.fingerprint or 'key unknown'})"
    return f"{head}: {WORDS[check.status]}" + (f": {check.detail}" if check.detail else "")

