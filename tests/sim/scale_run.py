"""The stored scale run (`tests/data/scale-run`, 743 records of an acceptance run against the sim) unpacked
into a run directory, and its records loaded the way the analysis first did: whole `Attempt`s, primary
layers filled in, a frame of their fields. The straightforward path the scale tests compare the lean loader
and the whole judgment with (test_analysis_scale.py, test_analysis_scale_records.py); no tests here."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pandas as pd

from k3load.analysis.run import rundata
from k3load.evidence import records_file
from k3load.records import Attempt, read_records
from k3load.workload.validate import primary_layer

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "scale-run"


def _unpack(dest: Path) -> Path:
    dest.mkdir()
    for path in DATA.iterdir():
        if path.name.endswith(".gz"):
            (dest / path.name[:-3]).write_bytes(gzip.decompress(path.read_bytes()))
        elif not path.name.endswith(".golden.json"):
            shutil.copy(path, dest / path.name)
    return dest


def _attempts_frame(path: Path) -> tuple[list[Attempt], pd.DataFrame]:
    """The loading path as it was: whole Attempts, primary layers filled in, a frame of their fields."""
    attempts = read_records(records_file(path))
    for a in attempts:
        if a.primary_layer is None and not a.valid:
            a.primary_layer = primary_layer(a.findings)
    rows = [{c: getattr(a, c) for c in rundata.RECORD_COLUMNS} | {"failed_layers": list(a.failed_layers)}
            for a in attempts]
    frame = pd.DataFrame(rows, columns=[*rundata.RECORD_COLUMNS, "failed_layers"])
    return attempts, frame.sort_values(["send_ts", "attempt_id"], kind="mergesort").reset_index(drop=True)
