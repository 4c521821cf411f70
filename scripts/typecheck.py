"""mypy over the harness as Python imports it: `k3load`, with `analysis/` as `k3load.analysis`; `locustfiles/` and
`bench/` (a namespace package: its scripts import each other as `bench.x`, hence --explicit-package-bases).

Why a script: the top-level `analysis/` folder is installed as `k3load.analysis` (setup.py's package_dir), which an
import hook of the editable install resolves at run time and mypy cannot follow; checked as it lies, every import
of `k3load.analysis.*` would be a missing module, silently typed `Any`. So the check runs in a temporary tree of
links laid out as the installed package (k3load/<each entry>, k3load/analysis -> analysis/) and reports paths as
they are in the repository. The settings are pyproject.toml's `[tool.mypy]`.

Usage: `python scripts/typecheck.py [extra mypy arguments]` -> mypy's exit status (0: clean).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def link_tree(into: Path) -> None:
    """k3load/ as installed: each entry linked, plus analysis/ as k3load/analysis; locustfiles/, bench/ beside."""
    package = into / "k3load"
    package.mkdir()
    for entry in (ROOT / "k3load").iterdir():
        if entry.name not in ("__pycache__", "analysis"):
            (package / entry.name).symlink_to(entry)
    (package / "analysis").symlink_to(ROOT / "analysis")
    (into / "locustfiles").symlink_to(ROOT / "locustfiles")
    (into / "bench").symlink_to(ROOT / "bench")


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="k3load-typecheck-") as tmp:
        link_tree(Path(tmp))
        done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                               "--cache-dir", str(ROOT / ".mypy_cache"), "--explicit-package-bases",
                               "k3load", "locustfiles", "bench", *argv],
                              cwd=tmp, capture_output=True, text=True)
    out = (done.stdout + done.stderr).replace("k3load/analysis/", "analysis/")
    sys.stdout.write(out)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
