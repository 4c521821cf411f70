"""A request's input length in tokens: the server's count where it gave one, else an estimate.

Why estimate: the server states a prompt's length only in the usage chunk at the end of a stream, so
the requests a crash cuts, exactly the ones whose size the OOM analysis needs, carry
`prompt_tokens: None`. The harness still knows the bytes it sent (`request_bytes`), and the same run's
finished requests give the tokens per byte of the same scenario turn (same template, tools and
history shape), or, failing that, of the whole run. An estimate is always marked as one.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from k3load.analysis.run.record_columns import MISSING_INT, Rows

Ratios = tuple[pd.Series, float | None]  # (median tokens/byte per (scenario, turn), over the run)


def tokens_per_byte(rows: Rows) -> Ratios:
    """Median tokens/byte per (scenario, turn) and over the run, from attempts the server measured. Grouped by
    pandas, as the rules always did (the mean of the two middle ratios where a group's count is even)."""
    prompt, size = rows.number("prompt_tokens"), rows.number("request_bytes")
    known = ~np.isnan(prompt) & ~np.isnan(size) & (size > 0)
    if not known.any():
        return pd.Series(dtype=float), None
    measured = rows[known]
    ratio = pd.Series(prompt[known] / size[known])
    turn = measured.ints("turn")
    keys = [measured.values("scenario"), pd.Series(turn).where(turn != MISSING_INT)]  # no turn: no group (NaN)
    return ratio.groupby(keys).median(), float(ratio.median())


def live_frame(rows: Rows) -> pd.DataFrame:
    """The few records a crash caught, in send order (ties by attempt id), as `input_tokens` reads them."""
    ids = rows.key_texts("attempt_id")
    sent = rows.number("send_ts")
    order = sorted(range(len(rows)), key=lambda i: (sent[i], "" if ids[i] is None else str(ids[i])))
    picked = rows.take(np.array(order, dtype=np.intp))
    turn = picked.ints("turn")
    return pd.DataFrame({"prompt_tokens": picked.number("prompt_tokens"),
                         "request_bytes": picked.number("request_bytes"),
                         "scenario": pd.Series(picked.values("scenario"), dtype=object),
                         "turn": pd.Series(turn).where(turn != MISSING_INT),
                         "max_tokens": picked.number("max_tokens")})


def input_tokens(rows: pd.DataFrame, ratios: Ratios) -> pd.DataFrame:
    """`input_tokens` (nullable int) and `input_tokens_estimated` (bool) for `rows`, indexed like it;
    `ratios`: the tokens per byte, learnt from the whole run (`tokens_per_byte`)."""
    per_turn, overall = ratios
    measured = rows["prompt_tokens"].astype("Float64")
    size = rows["request_bytes"].astype("Float64")
    keys = pd.MultiIndex.from_arrays([rows["scenario"], rows["turn"]])
    ratio = pd.Series(per_turn.reindex(keys).to_numpy(), index=rows.index, dtype="Float64")
    if overall is not None:
        ratio = ratio.fillna(overall)
    guess = (size * ratio).round()
    estimated = measured.isna() & guess.notna()
    tokens = measured.fillna(guess).round().astype("Int64")
    return pd.DataFrame({"input_tokens": tokens, "input_tokens_estimated": estimated.fillna(False).astype(bool)},
                        index=rows.index)
