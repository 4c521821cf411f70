"""A request's input length in tokens: the server's count where it gave one, else an estimate.

Why estimate: the server states a prompt's length only in the usage chunk at the end of a stream, so
the requests a crash cuts, exactly the ones whose size the OOM analysis needs, carry
`prompt_tokens: None`. The harness still knows the bytes it sent (`request_bytes`), and the same run's
finished requests give the tokens per byte of the same scenario turn (same template, tools and
history shape), or, failing that, of the whole run. An estimate is always marked as one.
"""

from __future__ import annotations

import pandas as pd

ESTIMATE_COLUMNS = ("input_tokens", "input_tokens_estimated")


def tokens_per_byte(frame: pd.DataFrame) -> tuple[dict[tuple[str, int], float], float | None]:
    """Median tokens/byte per (scenario, turn) and over the run, from attempts the server measured."""
    if "request_bytes" not in frame:
        return {}, None
    known = frame[frame["prompt_tokens"].notna() & frame["request_bytes"].notna() & (frame["request_bytes"] > 0)]
    if known.empty:
        return {}, None
    ratio = known["prompt_tokens"].astype(float) / known["request_bytes"].astype(float)
    per_turn = ratio.groupby([known["scenario"], known["turn"]]).median()
    return {(str(s), int(t)): float(r) for (s, t), r in per_turn.items()}, float(ratio.median())


def input_tokens(frame: pd.DataFrame) -> pd.DataFrame:
    """`input_tokens` (nullable int) and `input_tokens_estimated` (bool), indexed like `frame`."""
    per_turn, overall = tokens_per_byte(frame)
    values: list[int | None] = []
    estimated: list[bool] = []
    for row in frame.itertuples(index=False):
        if pd.notna(row.prompt_tokens):
            values.append(int(row.prompt_tokens))
            estimated.append(False)
            continue
        size = getattr(row, "request_bytes", None)
        ratio = per_turn.get((str(row.scenario), int(row.turn)), overall)
        if size is None or pd.isna(size) or ratio is None:
            values.append(None)
            estimated.append(False)
        else:
            values.append(round(float(size) * ratio))
            estimated.append(True)
    return pd.DataFrame({"input_tokens": pd.array(values, dtype="Int64"), "input_tokens_estimated": estimated},
                        index=frame.index)
