"""`report.html`: the same record as report.md, self-contained (inline CSS, plots as data URIs).

The body is report.md rendered by analysis/outputs/markdown_html.py; the plots are added after the verdict and the
capacity plan, and the signers' regions are filled as `k3load verify` renders them.
"""

from __future__ import annotations

import html
from typing import Any

from k3load.analysis.outputs import report_md, report_signers
from k3load.analysis.outputs.markdown_html import markdown_to_html
from k3load.analysis.outputs.plot_inputs import data_uri, report_plot_inputs

CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.2em;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px}
th{background:#f3f3f3}blockquote{border-left:4px solid #c00;margin:0;padding:.3em 1em;background:#fff3f3}
code{background:#f3f3f3;padding:0 3px}h1{font-size:1.6em}.verdict-go h1{color:#070}.verdict-limited h1{color:#a60}
.verdict-rebuild h1,.verdict-scale_up h1{color:#b00}img{max-width:100%;border:1px solid #ddd;margin:.5em 0}
h1,h2,h3{font-family:system-ui,"Noto Sans CJK JP","Noto Sans JP","Hiragino Sans","Yu Gothic","Meiryo","IPAGothic",
"TakaoPGothic","Droid Sans Fallback","Noto Sans CJK SC",sans-serif}"""
def render(judgment: Any, pngs: dict[str, bytes] | None = None) -> str:
    """`pngs`: the plots already drawn (`plots_beside`); None draws them here."""
    head, rest = report_md.render_parts(judgment)  # the plots right after the verdict and the capacity plan
    if pngs is None:
        from k3load.analysis.outputs import plots  # matplotlib: imported only where the plots are drawn

        pngs = plots.draw(report_plot_inputs(judgment))
    figures = "".join(f'<h3>{html.escape(name.replace("_", " "))}</h3><img alt="{html.escape(name)}" '
                      f'src="{data_uri(png)}">' for name, png in sorted(pngs.items()))
    title = html.escape(f"k3load — {judgment.verdict}")
    page = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{CSS}</style></head><body class=\"verdict-{judgment.verdict}\">{markdown_to_html(head)}"
            f"<h2>Plots</h2>{figures or '<p>no timeline to plot</p>'}{markdown_to_html(rest)}</body></html>\n")
    regions = report_signers.region_contents(f"{head}\n{rest}")  # rendered as k3load verify renders them
    return report_signers.with_regions(report_signers.raw_markers(page), report_signers.regions_html(regions))
