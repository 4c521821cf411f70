"""A request's input length in tokens: the server's count where it gave one, else an estimate.

Why estimate: the server states a prompt's length only in the usage chunk at the end of a stream, so
the requests a crash cuts, exactly the ones whose size the OOM analysis needs, carry
`prompt_tokens: None`. The harness still knows the bytes it sent (`request_bytes`), and the same run's
finished requests give the tokens per byte of the same scenario turn (same template, tools and
history shape), or, failing that, of the whole run. An estimate is always marked as one.
"""

from __future__ import annotations

import pandas as pd


def tokens_per_byte(frame: pd.DataFrame) -> tuple[pd.Series, float | None]:
    """Median tokens/byte per (scenario, turn) and over the run, from attempts the server measured."""
    if "request_bytes" not in frame:
        return pd.Series(dtype=float), None
    known = frame[frame["prompt_tokens"].notna() & frame["request_bytes"].notna() & (frame["request_bytes"] > 0)]
    if known.empty:
        return pd.Series(dtype=float), None
    ratio = known["prompt_tokens"].astype(float) / known["request_bytes"].astype(float)
    return ratio.groupby([known["scenario"], known["turn"]]).median(), float(ratio.median())


def input_tokens(rows: pd.DataFrame, learn_from: pd.DataFrame | None = None) -> pd.DataFrame:
    """`input_tokens` (nullable int) and `input_tokens_estimated` (bool) for `rows`, indexed like it;
    the tokens per byte are learnt from `learn_from` (the whole run), `rows` itself by default."""
    per_turn, overall = tokens_per_byte(rows if learn_from is None else learn_from)
    measured = rows["prompt_tokens"].astype("Float64")
    size = rows.get("request_bytes", pd.Series(pd.NA, index=rows.index)).astype("Float64")  # absent in old records
    keys = pd.MultiIndex.from_arrays([rows["scenario"], rows["turn"]])
    ratio = pd.Series(per_turn.reindex(keys).to_numpy(), index=rows.index, dtype="Float64")
    if overall is not None:
        ratio = ratio.fillna(overall)
    guess = (size * ratio).round()
    estimated = measured.isna() & guess.notna()
    tokens = measured.fillna(guess).round().astype("Int64")
    return pd.DataFrame({"input_tokens": tokens, "input_tokens_estimated": estimated.fillna(False).astype(bool)},
                        index=rows.index)
