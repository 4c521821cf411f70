"""`k3load analyze` draws the report's plots in a forked child while it judges (analysis/outputs/plots_beside.py):
the report must be the same bytes as when the judging process draws them, whatever happens to the child.

The forking cases run in a fresh interpreter: this test process is gevent-patched (conftest imports
locust), where PlotsBeside never forks, as the last test checks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3load.analysis.analyze import analyze
from k3load.analysis.outputs.plots_beside import PlotsBeside, forkable

DATA = Path(__file__).parents[1] / "data" / "scale-run"
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child is forked (Linux)")

# Judges argv[1] with a PlotsBeside: "collect" takes the plots from the child, "kill" kills the child first,
# "abandon" closes without collecting. Prints the children seen, the plots' equality with drawing here, and
# the children left after close.
SCRIPT = r"""
import json, os, signal, sys
from pathlib import Path
from k3load.analysis.outputs import plots
from k3load.analysis.analyze import judge
from k3load.analysis.outputs.plot_inputs import report_plot_inputs
from k3load.analysis.outputs.plots_beside import PlotsBeside
from k3load.analysis.run.timeline import shared_indexes

def children():
    return sorted(int(p) for t in Path(f"/proc/{os.getpid()}/task").iterdir()
                  for p in (t / "children").read_text().split())

mode, before = sys.argv[2], children()
plotter = PlotsBeside()
forked = [c for c in children() if c not in before]
same = None
try:
    if mode == "kill":
        os.kill(forked[0], signal.SIGKILL)
    if mode != "abandon":
        with shared_indexes():
            judgment = judge(Path(sys.argv[1]), plotter)
            here = plots.draw(report_plot_inputs(judgment))
        got = plotter.result()
        same = got == here and sorted(got) == ["latency_vs_concurrency", "pareto", "throughput_vs_concurrency",
                                          "timeline"]
finally:
    plotter.close()
print(json.dumps({"forked": len(forked), "same": same, "left": [c for c in children() if c not in before]}))
"""


def _run(dest: Path) -> Path:
    shutil.copytree(DATA, dest)
    return dest


@linux
def test_the_cli_report_holds_the_plots_the_judging_process_draws(tmp_path: Path) -> None:
    drawn_here = _run(tmp_path / "here")
    analyze(drawn_here)  # plots drawn in this process
    beside = _run(tmp_path / "beside")
    done = subprocess.run([sys.executable, "-m", "k3load", "analyze", str(beside)], capture_output=True, text=True)
    assert done.returncode == 3 and "not proven: Restart check" in done.stdout, done.stderr  # no restart stage
    html = (beside / "report.html").read_bytes()
    assert html == (drawn_here / "report.html").read_bytes()
    assert html.count(b"data:image/png;base64,") == 4  # latency and goodput, throughput, pareto, timeline


@linux
@pytest.mark.parametrize("mode", ["collect", "kill", "abandon"])
def test_the_child_draws_or_the_parent_does_and_no_child_is_left(tmp_path: Path, mode: str) -> None:
    """collect: the child's PNGs are the bytes drawn here; kill: a child killed before the inputs came
    leaves the drawing to the parent, same bytes, no error; abandon: an analysis that failed before its
    plots ends and reaps its child."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(_run(tmp_path / "run")), mode],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["forked"] == 1 and seen["left"] == []
    assert seen["same"] is (None if mode == "abandon" else True)


def test_a_gevent_patched_process_draws_its_plots_itself() -> None:
    assert not forkable()  # conftest's `import locust` patched this process
    plotter = PlotsBeside()
    assert plotter._pid is None
    plotter.close()
