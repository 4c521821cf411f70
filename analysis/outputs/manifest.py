"""`manifest.sha256` over every evidence file of a run, and `k3load verify DIR` to re-check it.

Why: the record must be signable. A signature over the manifest covers every file it lists; verify
says which file changed, went missing, or appeared without being covered. A report (report.md, report.html) is
hashed with its signer regions' content taken out: `k3load sign` writes who signed there after signing, and
`k3load verify` checks them against the signatures instead (analysis/outputs/report_signers.py). Left out: the manifest
itself and every file named after it (its signatures, their signers, stale sets: k3load.signing.record),
worker spools (copies of the records), and the files run.json names as `unsigned_files` (Locust's own
--csv / --json-file / --logfile outputs put inside the run directory, which Locust keeps writing after
the manifest is signed; run.json is itself covered, so that list cannot grow unnoticed). Compressed
evidence (records.jsonl.gz, metrics.jsonl.gz: k3load.evidence) is hashed as the bytes on disk: a changed
byte anywhere in the stream is a changed file, whether or not it still decompresses.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from k3load.analysis.outputs.report_signers import REPORTS, canonical
from k3load.rundir import read_manifest, write_atomic

MANIFEST = "manifest.sha256"
SKIPPED = (MANIFEST, "spool/")  # the manifest itself; worker spools are copies of the records


def _unsigned(run_dir: Path) -> set[str]:
    try:
        return set(json.loads((run_dir / "run.json").read_text()).get("unsigned_files") or [])
    except (OSError, ValueError, AttributeError):
        return set()


def _files(run_dir: Path) -> list[str]:
    out, unsigned = [], _unsigned(run_dir)
    for path in sorted(run_dir.rglob("*")):
        rel = path.relative_to(run_dir).as_posix()
        if path.is_file() and not rel.startswith(SKIPPED) and not path.name.startswith(".") and rel not in unsigned:
            out.append(rel)
    return out


def digest(path: Path) -> str:
    """A file's sha256; a report's over its bytes with its signer regions' content taken out: k3load sign writes
    who signed there after the manifest was signed, and k3load verify checks the regions against the
    signatures instead (analysis/outputs/report_signers.py)."""
    if path.name in REPORTS:
        return hashlib.sha256(canonical(path.read_bytes())).hexdigest()
    sha = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


Known = dict[str, tuple[int, int, str]]  # rel -> (size, mtime_ns, sha256) of a file hashed earlier


def digests(run_dir: Path, skip: tuple[str, ...] = ()) -> Known:
    """The files' digests now, each with the size and mtime it had when hashed (`skip`: names left out).
    Why: `k3load analyze` hashes the run's inputs (an hour's records: 650 MB of JSON lines, about 90 MB
    compressed) in a thread while it judges, hashlib working without the GIL; `write` takes a digest only
    if the file is unchanged."""
    known: Known = {}
    for rel in _files(run_dir):
        if rel in skip:
            continue
        try:
            before = (run_dir / rel).stat()
            sha = digest(run_dir / rel)
            after = (run_dir / rel).stat()
        except OSError:  # gone meanwhile (a temporary file): `write` hashes what is there at the end
            continue
        if (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns):
            known[rel] = (after.st_size, after.st_mtime_ns, sha)
    return known


def _digest(run_dir: Path, rel: str, known: Known) -> str:
    stat = (run_dir / rel).stat()
    found = known.get(rel)
    return found[2] if found and found[:2] == (stat.st_size, stat.st_mtime_ns) else digest(run_dir / rel)


def write(run_dir: Path, known: Known | None = None) -> int:
    lines = [f"{_digest(run_dir, rel, known or {})}  {rel}\n" for rel in _files(run_dir)]
    write_atomic(run_dir / MANIFEST, "".join(lines))
    return len(lines)


def verify(run_dir: Path) -> list[str]:
    """Problems found (empty: every listed file is intact and nothing is uncovered)."""
    manifest = run_dir / MANIFEST
    if not manifest.exists():
        return [f"{MANIFEST} is missing"]
    listed = read_manifest(manifest)
    problems = []
    for rel, sha in sorted(listed.items()):
        path = run_dir / rel
        if not path.exists():
            problems.append(f"missing: {rel}")
        elif digest(path) != sha:
            problems.append(f"changed: {rel}")
    problems += [f"not covered by the manifest: {rel}" for rel in _files(run_dir) if rel not in listed]
    return problems
