"""The stored scale run (`tests/data/scale-run`, 743 records of an acceptance run against the sim) unpacked
into a run directory, and its records loaded the way the analysis first did: whole `Attempt`s, primary
layers filled in, the record columns taken from them. The straightforward path the scale tests compare the lean loader
and the whole judgment with (test_analysis_scale.py, test_analysis_scale_records.py); no tests here."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np

from k3load.analysis.run.record_columns import FIELDS, RecordColumns
from k3load.analysis.run.rundata import columns_of
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


def _attempts_frame(path: Path) -> tuple[list[Attempt], RecordColumns]:
    """The loading path as it was: whole Attempts, primary layers filled in, and the columns taken from them (each
    as its line is read whole: `rundata.columns_of`, not the decoder's fast path)."""
    attempts = read_records(records_file(path))
    for a in attempts:
        if a.primary_layer is None and not a.valid:
            a.primary_layer = primary_layer(a.findings)
    return attempts, columns_of(attempts)


def same_columns(a: RecordColumns, b: RecordColumns) -> bool:
    """Every kept field of every record the same (NaN equal to NaN), and the same distinct values coded alike."""
    for name in FIELDS:
        x, y = a.array(name), b.array(name)
        if x.dtype != y.dtype or len(x) != len(y):
            return False
        if x.dtype == np.float64 and not np.array_equal(x, y, equal_nan=True):
            return False
        if x.dtype != np.float64 and not (x == y).all():
            return False
        codes_a, codes_b = a.columns[name].codes, b.columns[name].codes
        if codes_a is not None and codes_b is not None and repr(codes_a.values) != repr(codes_b.values):
            return False
        if a.columns[name].int_only != b.columns[name].int_only:
            return False
    return True
