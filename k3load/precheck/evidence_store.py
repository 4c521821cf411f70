"""The precheck's evidence folder itself: what was gathered (`Evidence`, loaded back for the rules) and the
`Gatherer` that copies inputs under DIR/evidence, redacted on the way, with the index of what came from where.

Why apart from k3load/precheck/evidence.py (which gathers from the server and the operator's files and loads it
all back): the per-node gathering (k3load/precheck/node_evidence.py) writes through the same Gatherer into the
same Evidence, and evidence.py calls it; with these types in evidence.py the two modules imported each other.
The folder's layout and the secrets' handling are described in evidence.py's docstring.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3load.client.access import Secrets
from k3load.private_files import make_dirs, make_run_dir, write_bytes_atomic
from k3load.rundir import copy_file_redacted, scrub_bytes, write_atomic, write_json_atomic

EVIDENCE = "evidence"


@dataclass
class Evidence:
    """Everything the rules may look at, loaded from DIR/evidence; None means "not gathered"."""

    server: dict[str, Any] | None = None
    container: dict[str, Any] | None = None  # the single-node form's collect-env (a bare path)
    image: str | None = None
    hosts: list[dict[str, Any]] = field(default_factory=list)
    startup: dict[str, Any] | None = None  # the single-node form's startup log
    node_containers: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> its collect-env facts
    node_startups: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> its startup log facts
    custom_build: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # kind -> path relative to DIR/evidence


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def redact_body(data: bytes, secrets: Secrets) -> bytes:
    """Every secret replaced in every form, also one a JSON body hides behind escapes (`\\u0073k-...`),
    the rest of the body byte for byte as received."""
    return secrets.redact_bytes(data) if secrets else data


class Gatherer:
    """Copies inputs under DIR/evidence and keeps the index of what came from where."""

    def __init__(self, out_dir: Path, secrets: Secrets | None = None) -> None:
        self.out_dir = out_dir
        self.secrets = secrets or Secrets()
        self.root = out_dir / EVIDENCE
        if self.root.exists():
            shutil.rmtree(self.root)  # a record must hold only this run's evidence (and no interrupted copy)
        make_run_dir(out_dir)
        make_dirs(self.root)
        self.index: dict[str, Any] = {"files": [], "notes": []}

    def _record(self, rel: str, source: str, sha256: str | None = None, size: int | None = None) -> None:
        path = self.root / rel
        self.index["files"].append({"path": rel, "source": source, "sha256": sha256 or sha256_file(path),
                                    "bytes": path.stat().st_size if size is None else size})

    def copy(self, src: Path, rel: str) -> None:
        """`src` copied to `rel`, redacted on the way (k3load.rundir.copy_file_redacted)."""
        copied = copy_file_redacted(src, self.root / rel, self.secrets)
        if copied.redacted:
            self.note(f"{rel}: secrets redacted from the copy of {Path(src).resolve()}")
        self._record(rel, str(Path(src).resolve()), copied.sha256, copied.bytes)

    def write(self, rel: str, content: bytes | str | Any, source: str) -> None:
        path = self.root / rel
        if isinstance(content, bytes):
            write_bytes_atomic(path, scrub_bytes(redact_body(content, self.secrets)))
        elif isinstance(content, str):
            write_atomic(path, self.secrets.redact(content))
        else:
            write_json_atomic(path, json.loads(self.secrets.redact(json.dumps(content))))
        self._record(rel, source)

    def note(self, text: str) -> None:
        self.index["notes"].append(text)

    def finish(self) -> None:
        write_json_atomic(self.root / "index.json", self.index)
