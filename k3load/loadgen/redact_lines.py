"""A restart command's output, copied to its log with every secret of the run replaced.

    python -m k3load.loadgen.redact_lines FILE     # stdin -> FILE, secrets from $K3LOAD_REDACT_VALUES

Why a process of its own rather than a thread of the harness: the command usually starts a server that
outlives the run (`--k3-restart-cmd "exec vllm serve ..."`), and a server often prints the arguments it
was started with, key included. A copier inside the harness would stop when the run ends and leave the
server writing into a closed pipe; this one lives as long as the server's output does, and writes only
redacted lines. The values travel in the environment, never on a command line (`ps` shows those).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from k3load.client.secret_forms import Redactor
from k3load.private_files import open_private
from k3load.rundir import secret_values

VALUES_ENV = "K3LOAD_REDACT_VALUES"


def copy_redacted(proc: subprocess.Popen[bytes], log_path: Path) -> subprocess.Popen[bytes]:
    """Start the copier on `proc`'s stdout (then closed here: the copier holds the only reader)."""
    assert proc.stdout is not None
    env = {**os.environ, VALUES_ENV: json.dumps(list(secret_values()))}
    # Its own stdout and stderr go nowhere: inheriting the harness's would hold the pipe of whoever reads
    # the run's console (a CI step, `communicate()`) open as long as the restarted server lives.
    copier = subprocess.Popen([sys.executable, "-m", "k3load.loadgen.redact_lines", str(log_path)],
                              stdin=proc.stdout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                              start_new_session=True)
    proc.stdout.close()
    return copier


def main(argv: list[str]) -> int:
    """Every secret replaced in every form (k3load.client.secret_forms) before a byte is written; the log
    is created 0600, as every file of a run directory."""
    redactor = Redactor(json.loads(os.environ.pop(VALUES_ENV, "[]")))
    with open_private(Path(argv[0]), "ab") as out:
        for line in sys.stdin.buffer:
            out.write(redactor.redact_bytes(line) if redactor else line)
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
