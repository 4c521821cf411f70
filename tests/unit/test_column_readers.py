"""Rules moved from the attempts read whole to the record columns give what they gave: each one's column reading
against its reading of every attempt whole, over runs of any shape (analysis/run/record_columns.py: the columns
choose the few records a rule still reads whole, `RunData.pick`, and count the rest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from k3load.analysis.pillars.agent.retry_paths import _path_counts, path_counts
from k3load.analysis.run.rundata import RunData
from k3load.records import Attempt
from k3load.workload.retry_policy import AttemptPath

CHAINS = ("c0", "c1", "c2", "0123456789abcdef0123456789abcdef", None)


@st.composite
def attempts(draw: Any) -> list[Attempt]:
    """Chains of retries and fallbacks in any order, numbered as records number them or not (a float, a string),
    with or without their recorded path."""
    out = []
    for i in range(draw(st.integers(0, 12))):
        number = draw(st.sampled_from([1, 1, 1, 2, 3, 1.0, 2.0, "2"]))
        out.append(Attempt(
            run_id="r", attempt_id=f"a{i}", chain_id=draw(st.sampled_from(CHAINS)), attempt=number, stage="load",
            scenario="s", family="agent", turn=0, turn_kind="answer", user_id="u",
            request_sha256=draw(st.sampled_from(["x", "y"])), prefix_sha256="p", transport="fake", status="ok",
            send_ts=1.0, end_ts=2.0, valid=draw(st.booleans()), will_retry=draw(st.booleans()),
            drill=draw(st.booleans()),
            path=draw(st.sampled_from([None, *(p.value for p in AttemptPath), "other"]))))
    return out


@settings(max_examples=150, deadline=None)
@given(attempts())
def test_path_counts_on_the_columns_are_those_of_every_attempt_read_whole(run: list[Attempt]) -> None:
    try:
        whole = _path_counts(run)
    except TypeError:  # a string numbered attempt compared with an integer: the rule fails on it either way
        return
    assert path_counts(RunData(path=Path("."), attempts=run)) == whole
