"""The HTML report opened in headless Chromium (Debian's), with a screenshot kept under runs/ci-report/
as a CI artifact: the self-contained report must render with its verdict, tables and plots."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from k3load.analysis.analyze import analyze
from tests.sim.test_verdicts import STAGES, accept

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "runs" / "ci-report"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("chromium is missing on CI: `make test` installs Debian's chromium first")
    pytest.skip("chromium is not installed here (make test installs it on Debian)")


@pytest.mark.slow
def test_report_renders_in_headless_chromium(start_sim, tmp_path):
    browser = _chromium()
    _, _, out = accept(start_sim, tmp_path, [], stages=STAGES)
    analyze(out)
    if ARTIFACTS.exists():
        shutil.rmtree(ARTIFACTS)
    shutil.copytree(out, ARTIFACTS)
    shot = ARTIFACTS / "report.png"
    profile = tmp_path / "chromium-profile"
    base = [browser, *FLAGS, f"--user-data-dir={profile}"]
    url = (ARTIFACTS / "report.html").as_uri()
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert "k3load acceptance record" in dom.stdout and "Prefix cache: cold vs warm" in dom.stdout
    assert dom.stdout.count("data:image/png;base64,") >= 4  # latency and goodput, throughput, pareto, timeline
    # what a planner reads first (issue 27): the capacity plan and the plots right after the verdict
    page = dom.stdout
    assert page.index("Verdict:") < page.index("Capacity plan") < page.index(">Plots<") < page.index("Limits that hold")
    assert 'alt="pareto"' in page and 'alt="latency_vs_concurrency"' in page
    # every evidence link of the checklist opens a file of the run (records and metrics are written .gz)
    links = set(re.findall(r'<a href="([^"#:]+)"', page))
    assert links and all((ARTIFACTS / link).is_file() for link in links), sorted(links)
    assert "records.jsonl.gz" in links
    subprocess.run([*base, f"--screenshot={shot}", "--window-size=1280,3000", url], capture_output=True,
                   timeout=120, check=True)
    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
