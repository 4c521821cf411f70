"""bench/peers.py runs end to end in a tiny mode and prints its table (k3load's two clients only: the
peers' venvs are not built in CI). No timing is asserted: performance claims live in the bench's own
ratios, measured in one run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_peers_bench_prints_its_table_in_a_tiny_mode(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "peers.py"), "--peers", "k3load-locust", "k3load-client",
           "--streams", "4", "--tokens", "48", "--rate", "1000", "--duration-s", "0.4", "--warmup-s", "0.2",
           "--keep", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "µs CPU/chunk" in out and "late p99 ms" in out, out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("k3load-")}
    assert set(rows) == {"k3load-locust", "k3load-client"}, out
    assert all("failed" not in row for row in rows.values()), out
    assert "k3load-locust / k3load-client: CPU/chunk" in out, out
