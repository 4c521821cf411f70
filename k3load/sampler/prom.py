"""Parse one Prometheus text body (vLLM /metrics, dcgm-exporter) into the sampler's compact shape.

Pure functions, no I/O: a test feeds a captured body, the sampler feeds a live one. Parsing goes
through `prometheus_client.parser` only (never by hand), so every quirk of the exposition format
(escapes, `+Inf`, HELP/TYPE order) is the library's problem, not ours.

The shape kept per scrape (see `k3load.sampler` for the whole metrics.jsonl line):
- `samples`: `{"name{k=\"v\",...}": value}` for every `vllm:*` sample, label names sorted and values
  escaped as in the exposition format, so a key is stable from scrape to scrape and the analysis can
  subtract two scrapes key by key (counter deltas, histogram `_bucket`/`_sum`/`_count` deltas) or read
  a gauge as is. Left out: `*_created` samples (series creation timestamps, not measurements) and
  `vllm:*_info` gauges (always 1; their labels are the information and go to events on change).
- `types`: `{family: "counter"|"gauge"|"histogram"|...}` as the server declared them.
- `legacy`: the old-named families present (`vllm:gpu_cache_usage_perc`, ...) mapped to today's name.

Metrics count as present only when the scheduler and KV-cache gauges are (`REQUIRED_SERIES`, see
`absent_required`), not when any vllm:* series is: vLLM 0.32 started with `--disable-log-stats` still
serves `vllm:tool_call_parser_invocations_total` (12 series) and nothing else under vllm:.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from k3load.sampler.vllm_metrics import LEGACY, VLLM_PREFIX, VllmMetric

DCGM_PREFIX = "DCGM_FI_"
# Families renamed in vLLM's v1 metrics (vllm/v1/metrics/loggers.py): still accepted from older
# servers, labelled as legacy so a report never mixes them up with today's series silently.
LEGACY_FAMILIES: dict[str, str] = {old.value: new.value for old, new in LEGACY.items()}
# The engine's state every load judgment reads (analysis/pillars/headroom/stages.py): absent, the server's view of a run
# is unknown whatever other vllm:* series remain. Names as on the wire (gauges: the family's own name).
REQUIRED_SERIES: tuple[str, ...] = (VllmMetric.NUM_REQUESTS_RUNNING, VllmMetric.NUM_REQUESTS_WAITING,
                                    VllmMetric.KV_CACHE_USAGE)
_MONOTONIC_SUFFIXES = ("_total", "_count", "_sum", "_bucket")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Parsed:
    """One body, split by what the sampler does with each part."""

    samples: dict[str, float | None] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)
    monotonic: set[str] = field(default_factory=set)  # sample names that only go up between restarts
    legacy: dict[str, str] = field(default_factory=dict)
    infos: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    dcgm: dict[str, list[tuple[dict[str, str], float | None]]] = field(default_factory=dict)
    process_start_ts: float | None = None

    @property
    def vllm_series(self) -> int:
        """How many vllm:* series the body had (info gauges included): 0 means metrics are missing."""
        return len(self.samples) + sum(len(v) for v in self.infos.values())


def parse(text: str) -> Parsed:
    """Parse a whole body; raises ValueError (from prometheus_client) on text that is not the format."""
    out = Parsed()
    for family in text_string_to_metric_families(text):
        if family.name.startswith(VLLM_PREFIX):
            _take_vllm(out, family.name, family.type, family.samples)
        elif family.name.startswith(DCGM_PREFIX):
            out.dcgm[family.name] = [(dict(s.labels), _number(s.value)) for s in family.samples]
        elif family.name == "process_start_time_seconds":
            out.process_start_ts = _number(family.samples[0].value) if family.samples else None
    return out


def _take_vllm(out: Parsed, name: str, kind: str, samples: Iterable[Sample]) -> None:
    if name.endswith("_created"):
        return
    if name.endswith("_info") or kind == "info":
        info_name = name if name.endswith("_info") else name + "_info"
        out.infos.setdefault(info_name, []).extend(dict(s.labels) for s in samples)
        return
    out.types[name] = kind
    if name in LEGACY_FAMILIES:
        out.legacy[name] = LEGACY_FAMILIES[name]
    for sample in samples:
        if sample.name.endswith("_created"):
            continue
        if kind in ("counter", "histogram", "summary") and sample.name.endswith(_MONOTONIC_SUFFIXES):
            out.monotonic.add(sample.name)
        out.samples[sample_key(sample.name, sample.labels)] = _number(sample.value)


def rebuild(readings: Iterable[tuple[str, Mapping[str, str], float | None]]) -> Parsed:
    """A `Parsed` from (sample name, labels, value) readings that did not come as exposition text (a
    Prometheus query answer), keyed exactly as `parse` keys a scrape so both lines subtract alike.

    Why by suffix: the query API carries no TYPE lines, so `types` stays empty and the counters and
    histogram parts (the only series a reset can concern) are known by their `_total`/`_bucket`/`_sum`/
    `_count` suffix; `process_start_time_seconds` is kept for restarts, `*_info` series go to `infos`.
    """
    out = Parsed()
    for name, labels, value in readings:
        if name == "process_start_time_seconds":
            out.process_start_ts = value
        elif not name.startswith(VLLM_PREFIX) or name.endswith("_created"):
            continue
        elif name.endswith("_info"):
            out.infos.setdefault(name, []).append(dict(labels))
        else:
            family = next((name.removesuffix(s) for s in _MONOTONIC_SUFFIXES if name.endswith(s)), name)
            if family in LEGACY_FAMILIES:
                out.legacy[family] = LEGACY_FAMILIES[family]
            if name.endswith(_MONOTONIC_SUFFIXES):
                out.monotonic.add(name)
            out.samples[sample_key(name, labels)] = value
    for label_sets in out.infos.values():
        label_sets.sort(key=lambda labels: sorted(labels.items()))
    return out


def number(text: str | float) -> float | None:
    """A sample value as JSON can hold it ("NaN", "+Inf" as Prometheus's API spells them: None)."""
    return _number(float(text))


def series_names(parsed: Parsed) -> dict[str, int]:
    """How many series each vllm:* sample name has (info gauges included), in the order first seen."""
    counts: dict[str, int] = {}
    for key in parsed.samples:
        name = key.partition("{")[0]
        counts[name] = counts.get(name, 0) + 1
    for name, label_sets in parsed.infos.items():
        counts[name] = counts.get(name, 0) + len(label_sets)
    return counts


def absent_required(parsed: Parsed, required: tuple[str, ...] = REQUIRED_SERIES) -> list[str]:
    """The required series the body lacks; a legacy name (`vllm:gpu_cache_usage_perc`) stands for today's."""
    present = set(series_names(parsed))
    present |= {LEGACY_FAMILIES[name] for name in present if name in LEGACY_FAMILIES}
    return [name for name in required if name not in present]


def _number(value: float) -> float | None:
    """NaN and infinities are not JSON: unknown is None, never a made-up 0."""
    value = float(value)
    return value if math.isfinite(value) else None


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def sample_key(name: str, labels: Mapping[str, str]) -> str:
    """`name{a="1",b="2"}` with sorted label names; `name` alone when there are no labels."""
    if not labels:
        return name
    inner = ",".join(f'{key}="{_escape(str(labels[key]))}"' for key in sorted(labels))
    return f"{name}{{{inner}}}"


def split_key(key: str) -> tuple[str, dict[str, str]]:
    """The inverse of `sample_key`: for the analysis, which groups samples by name and labels."""
    name, brace, rest = key.partition("{")
    if not brace:
        return name, {}
    return name, {m.group(1): _unescape(m.group(2)) for m in _LABEL.finditer(rest[:-1])}


def counter_resets(previous: Mapping[str, float | None], current: Mapping[str, float | None],
                   monotonic: set[str]) -> list[str]:
    """Keys of counters/histogram parts that went down: the server restarted (or a series was reset).

    Why per key: a deployment behind a load balancer may restart one engine while others keep counting.
    """
    down = []
    for key, value in current.items():
        before = previous.get(key)
        if value is None or before is None or key.partition("{")[0] not in monotonic:
            continue
        if value < before:
            down.append(key)
    return down
