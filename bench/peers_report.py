"""bench/peers.py's figures: one client's `Result` at one stream and token count, the median over rounds,
and the printed table with its ratios and the fitted fixed cost per request.

Why apart from bench/peers.py (which runs the server and the clients and measures): what a figure means and
how it is printed does not depend on how it was measured, and the measuring script stays under 400 lines.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

FULL = 0.95  # the streams count as full at this share of the stream count
LATE_SHARE_MS = 0.5  # first tokens later than this are counted apart


@dataclass
class Result:
    """One client's figures at one stream and token count (None: not measured; `error`: the run failed)."""

    client: str
    streams: int
    tokens: int
    us_per_chunk: float | None = None
    ms_per_request: float | None = None
    late_p50_ms: float | None = None
    late_p99_ms: float | None = None
    late_note: str = ""
    late_over: float | None = None  # the share of first tokens later than LATE_SHARE_MS
    held: float = 0.0  # streams open on the server, mean of the interval's two ends
    client_cpu: float = 0.0  # share of one core over the interval
    server_cpu: float = 0.0
    chunks_per_s: float = 0.0
    window_s: float = 0.0
    error: str = ""


def median_of_rounds(rounds: list[Result]) -> Result:
    """Each figure's median over the rounds that measured it; the notes of the first such round."""
    ok = [r for r in rounds if not r.error]
    if not ok:
        return rounds[0]
    merged = Result(ok[0].client, ok[0].streams, ok[0].tokens, late_note=ok[0].late_note)
    for name in ("us_per_chunk", "ms_per_request", "late_p50_ms", "late_p99_ms", "held", "client_cpu", "server_cpu",
                 "chunks_per_s", "window_s"):
        values = [getattr(r, name) for r in ok if getattr(r, name) is not None]
        setattr(merged, name, statistics.median(values) if values else None)
    if len(rounds) > 1:
        merged.late_note += f" (median of {len(ok)} rounds)"
        late = [r for r in ok if r.late_p99_ms is not None and r.late_over is not None]
        if late:
            merged.late_note += (f"; by round, p99 ms {' '.join(f'{r.late_p99_ms:.2f}' for r in late)}, share > "
                                 f"{LATE_SHARE_MS} ms {' '.join(f'{r.late_over:.1%}' for r in late)}")
    return merged


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def report(results: dict[tuple[int, int], list[Result]], skipped: dict[str, str]) -> None:
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    head = (f"{'client':<19} {'µs CPU/chunk':>12} {'ms CPU/req':>10} {'late p50 ms':>11} {'late p99 ms':>11} "
            f"{'client CPU':>10} {'server CPU':>10} {'chunks/s':>9} {'window s':>8}")
    for (streams, tokens), rows in results.items():
        print(f"\n{streams} streams, {tokens} tokens/request\n{head}")
        for r in rows:
            if r.error:
                print(f"{r.client:<19}  failed: {r.error}")
                continue
            print(f"{r.client:<19} {_num(r.us_per_chunk, '12.1f')} {_num(r.ms_per_request, '10.2f')} "
                  f"{_num(r.late_p50_ms, '11.2f')} {_num(r.late_p99_ms, '11.2f')} {r.client_cpu:>10.0%} "
                  f"{r.server_cpu:>10.0%} {r.chunks_per_s:>9,.0f} {r.window_s:>8.1f}  {r.late_note}"
                  + (f", held ~{r.held:.0f} streams" if r.held < streams * FULL else ""))
        _ratios(rows)
    _fixed_overhead(results)


def _fixed_overhead(results: dict[tuple[int, int], list[Result]]) -> None:
    """With two or more token counts: CPU per request = fixed + tokens x marginal per chunk, fitted by least
    squares per client and stream count (the issue's "fixed overhead per request")."""
    by: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for (streams, tokens), rows in results.items():
        for r in rows:
            if r.ms_per_request is not None:
                by.setdefault((r.client, streams), []).append((tokens, r.ms_per_request))
    fits = {key: pts for key, pts in by.items() if len({t for t, _ in pts}) >= 2}
    if fits:
        print("\nper-request CPU = fixed + tokens x marginal (least squares over the token counts)")
    for (client, streams), pts in fits.items():
        mean_t, mean_c = sum(t for t, _ in pts) / len(pts), sum(c for _, c in pts) / len(pts)
        slope = sum((t - mean_t) * (c - mean_c) for t, c in pts) / sum((t - mean_t) ** 2 for t, _ in pts)
        print(f"  {client:<19} {streams:>4} streams: fixed {mean_c - slope * mean_t:6.3f} ms/request, "
              f"marginal {slope * 1000:6.1f} µs/chunk")


def _ratios(rows: list[Result]) -> None:
    """Each k3load client over each peer; the full worker path over the bare client; and, with
    --baseline, each k3load client over the same client run from the baseline tree."""
    ok = {r.client: r for r in rows if not r.error}
    pairs = [(mine, ref) for mine in ("k3load-locust", "k3load-client") for ref in ok
             if not ref.startswith("k3load")]
    pairs += [("k3load-locust", "k3load-client"), ("k3load-locust", "k3load-locust@base"),
              ("k3load-client", "k3load-client@base")]
    for mine, ref in pairs:
        if mine in ok and ref in ok:
            parts = [f"{label} {_ratio(getattr(ok[mine], f), getattr(ok[ref], f))}" for label, f in
                     (("CPU/chunk", "us_per_chunk"), ("CPU/request", "ms_per_request"),
                      ("late p50", "late_p50_ms"), ("late p99", "late_p99_ms"))]
            print(f"  {mine} / {ref}: " + ", ".join(parts))


def _ratio(mine: float | None, ref: float | None) -> str:
    return f"{mine / ref:.2f}x" if mine is not None and ref else "n/a"
