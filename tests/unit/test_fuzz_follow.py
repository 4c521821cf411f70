"""A follower read a chunk at a time gives exactly what a whole read gives (issue 31): any bytes, any chunk size,
compressed or plain, the file growing between reads, a torn last line waiting for its end."""

from __future__ import annotations

import gzip
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3load.evidence import Follow

TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


def _expected(pieces: list[str]) -> list[str]:
    whole = "".join(pieces)
    return [line + "\n" for line in whole.split("\n")[:-1]]


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(TEXT, max_size=12), chunk=st.integers(min_value=1, max_value=64), compressed=st.booleans())
def test_chunked_reads_of_a_growing_file_give_the_whole_reads_lines(pieces: list[str], chunk: int,
                                                                    compressed: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("log.jsonl.gz" if compressed else "log.jsonl")
        follow, got = Follow(path), []
        for piece in pieces:  # each piece appended (a gzip member of its own, as a writer's flush makes), then read
            data = piece.encode()
            with path.open("ab") as handle:
                handle.write(gzip.compress(data) if compressed else data)
            got += list(follow.iter_new_lines(chunk_bytes=chunk))
        assert got == _expected(pieces)
