"""Who signed, in the reports: the signature block's signer table and the checklist's judge line, filled in
by `k3load sign` after the run was judged, without changing what any signature covers.

    text = with_signers(report_md_text, signers, "md")        # the regions rewritten for these signers
    canonical(data)                                           # the bytes manifest.sha256 hashes for a report

Why regions: a signature covers manifest.sha256, which covers report.md and report.html; writing a signer's
name into a report after signing would change the manifest and break the signature just made (and every
earlier signer's). So each report marks two regions, `<!--k3load:signers-->…<!--/k3load:signers-->` (after
the signature table) and `<!--k3load:judge-->…<!--/k3load:judge-->` (inside the checklist's judge line),
and the manifest hashes a report with their content taken out (`canonical`): the rest of the report is
covered as any evidence file, and the regions are covered by `k3load verify` instead, which re-renders them
from manifest.sha256.signers.json, whose entries it holds to the signatures themselves (their keys'
fingerprints). So an edited region, an edited signers file or an edited report all fail verification.
The identities and times shown are the signers' claims; who the allowed-signers file says signed is what
`k3load verify --allowed-signers` prints.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from k3load.analysis.outputs.markdown import fmt
from k3load.analysis.outputs.markdown_html import inline_html, markdown_to_html

REPORTS = ("report.md", "report.html")
REGIONS = ("signers", "judge")
_REGION = re.compile(rb"(<!--k3load:(signers|judge)-->)(.*?)(<!--/k3load:\2-->)", re.DOTALL)
NOT_SIGNED = "not signed yet (k3load sign)"


def marked(name: str, content: str) -> str:
    return f"<!--k3load:{name}-->{content}<!--/k3load:{name}-->"


def canonical(data: bytes) -> bytes:
    """A report's bytes with its regions' content taken out (what manifest.sha256 hashes)."""
    return _REGION.sub(rb"\1\4", data)


def signers_md(signers: Sequence[Any]) -> str:
    """The signer table's Markdown (between the markers, each on its own line)."""
    if not signers:
        return f"\n\n| signed by | {NOT_SIGNED} |\n|---|---|\n\n"
    rows = "".join(f"| {fmt(s.identity)} (as claimed) | `{fmt(s.fingerprint)}` ({fmt(s.key_type)}) | "
                   f"{fmt(s.signed_at)} |\n" for s in signers)
    return f"\n\n| signed by | key | at |\n|---|---|---|\n{rows}\n"


def judge_md(signers: Sequence[Any], judge: str) -> str:
    """The checklist judge line's detail: the judge named at the run (--k3-judge) and who signed."""
    named = fmt(f"judge {judge!r}") if judge else "judge to be filled in before signing"
    if not signers:
        return named
    return f"{named}; signed by " + ", ".join(fmt(f"{s.identity} ({s.fingerprint}, {s.signed_at})")
                                             for s in signers)


def regions_md(signers: Sequence[Any], judge: str) -> dict[str, str]:
    return {"signers": signers_md(signers), "judge": judge_md(signers, judge)}


def with_regions(text: str, contents: dict[str, str]) -> str:
    """`text` with each region's content replaced (the markers kept)."""
    def sub(match: re.Match[str]) -> str:
        return match.group(1) + contents.get(match.group(2), match.group(3)) + match.group(4)
    return re.sub(_REGION.pattern.decode(), sub, text, flags=re.DOTALL)


def region_counts(text: str) -> dict[str, int]:
    """How often each region opens in a report: once each in a report k3load wrote. More means text that
    looks like a marker came in with the evidence (a quoted server error, a tool name), and its content would
    go unhashed: `k3load verify` refuses such a report."""
    return {name: text.count(f"<!--k3load:{name}-->") + text.count(f"&lt;!--k3load:{name}--&gt;")
            for name in REGIONS}


def region_contents(text: str) -> dict[str, str]:
    return {m.group(2): m.group(3) for m in re.finditer(_REGION.pattern.decode(), text, flags=re.DOTALL)}


_ESCAPED_BLOCK = re.compile(r"<p>&lt;!--(/?)k3load:(signers|judge)--&gt;</p>")
_ESCAPED_INLINE = re.compile(r"&lt;!--(/?)k3load:(signers|judge)--&gt;")


def raw_markers(html_text: str) -> str:
    """report.html as the Markdown renderer left it, its region markers made HTML comments again (it escapes
    every `<` of the Markdown, the markers' too)."""
    return _ESCAPED_INLINE.sub(r"<!--\1k3load:\2-->", _ESCAPED_BLOCK.sub(r"<!--\1k3load:\2-->", html_text))


def regions_html(contents_md: dict[str, str]) -> dict[str, str]:
    """Each region's HTML, rendered from its Markdown (the one rendering report.html and `k3load verify` use)."""
    return {name: markdown_to_html(md) if name == "signers" else inline_html(md) for name, md in contents_md.items()}


def expected(signers: Sequence[Any], judge: str) -> dict[str, dict[str, str]]:
    """Each report's regions for these signers: {"report.md": {...}, "report.html": {...}}."""
    md = regions_md(signers, judge)
    return {"report.md": md, "report.html": regions_html(md)}
