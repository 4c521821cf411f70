"""The report's "Prefix reuse: designed vs achieved" section (report.md, and report.html through it).

Why its own module: the table reads only `numbers.reuse` of the prefix_cache pillar (analysis/pillars/cache/reuse.py),
so the report says exactly what verdict.json says, with the intervals beside the ratios.
"""

from __future__ import annotations

from typing import Any

from k3load.analysis.outputs.markdown import fmt, table

COLUMNS = ("family", "requests", "distinct_requests", "windows", "prompt_tokens", "designed_share", "achieved_share",
           "achieved_share_ci95", "achieved_of_design", "achieved_of_design_ci95", "reached_design", "finding")


def _pct(value: float | None) -> str | None:
    return f"{value:.1%}" if value is not None else None


def _ci(bounds: list[float] | None) -> str | None:
    return f"{bounds[0]:.1%}-{bounds[1]:.1%}" if bounds else None


def _reached(reached: dict[str, Any]) -> str | None:
    """k/n attempts, with the distinct requests they repeat and the interval over those."""
    if not reached.get("n"):
        return None
    said = f"{reached.get('k')}/{reached.get('n')}"
    if reached.get("distinct_requests") is not None:
        said += f" ({reached['distinct_requests']} distinct, 95% CI {_ci(reached.get('ci95'))})"
    return said


def _row(name: str, row: dict[str, Any]) -> dict[str, Any]:
    reached = row.get("reached_design") or {}
    finding = row.get("finding") or {}
    return {"family": name, "requests": row.get("attempts_with_usage"),
            "distinct_requests": row.get("distinct_requests"), "windows": row.get("windows"),
            "prompt_tokens": row.get("prompt_tokens"),
            "designed_share": _pct(row.get("designed_share")), "achieved_share": _pct(row.get("achieved_share")),
            "achieved_share_ci95": _ci(row.get("achieved_share_ci95")),
            "achieved_of_design": _pct(row.get("achieved_of_design")),
            "achieved_of_design_ci95": _ci(row.get("achieved_of_design_ci95")),
            "reached_design": _reached(reached),
            "finding": (f"{finding.get('status')}" + (f" ({finding['layer']})" if finding.get("layer") else ""))
            if finding else None}


def markdown(cache_numbers: dict[str, Any]) -> str:
    reuse = cache_numbers.get("reuse")
    head = "## Prefix reuse: designed vs achieved\n\n"
    if not reuse:
        return head + "Not judged.\n"
    if reuse.get("status") != "measured":
        return head + f"{reuse.get('reason')}.\n"
    rows = [_row(name, row) for name, row in sorted(reuse.get("families", {}).items())]
    total = reuse.get("run") or {}
    rows.append(_row("run (records)", total))
    metrics = total.get("metrics") or {}
    design = [{"scenario": name, **{k: v for k, v in d.items() if k != "shared_along_chain_tokens"},
               "shared_along_chain_tokens": ", ".join(str(t) for t in d.get("shared_along_chain_tokens") or [])}
              for name, d in sorted((reuse.get("design") or {}).items())]
    design_cols = ("scenario", "family", "prefix_salt", "prompt_tokens_turn_0", "shared_across_requests_tokens",
                   "shared_along_chain_tokens", "salt_at_token", "tools_before_salt")
    gaps = "".join(f"- evidence gap: {g}\n" for g in reuse.get("evidence_gaps") or [])
    return (head + "Designed: the tokens a request shares with one whose prefill finished before it was sent (the "
            "server's /tokenize, `reuse_design.json`), whole blocks of "
            f"{reuse.get('block_size')} tokens. Achieved: the responses' cached_tokens. Intervals: 95% bootstrap "
            "over windows of the run (attempts sent together met the same cache, so a window is resampled whole, "
            "never its attempts one by one); reached_design's over its distinct requests.\n\n" + table(rows, COLUMNS)
            + f"\nServer counters over the run: {fmt(metrics.get('prefix_cache_hits'))} prefix-cache hit tokens of "
            f"{fmt(metrics.get('prefix_cache_queries'))} queried (hit share {fmt(_pct(metrics.get('hit_share')))}).\n\n"
            + gaps + ("\n" if gaps else "") + "What the samples share by design (tokens):\n\n"
            + table(design, design_cols) + "\n")
