"""A run's /metrics scrapes held compactly (analysis/run/scrape_samples.py) read exactly as the dicts they were.

Why property tests: the compact form regroups each scrape's values by series name, so a name's sum is one
slice; a regrouping that summed in another order, dropped a key or mixed two scrapes' layouts would change
verdict figures by a last bit or more. Held here against plain reference code on scrapes of any shape:
names interleaved (a histogram's _bucket, _sum and _count per label set), NaN and signed zeros, and the
values a compact scrape may not hold (None, integers), which keep their dict.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from k3load.analysis.run.scrape_samples import Layouts, Samples
from k3load.analysis.run.timeline import MetricIndex
from k3load.sampler.prom import split_key

NAMES = ("vllm:a_total", "vllm:h_bucket", "vllm:h_sum", "vllm:h_count", "vllm:g")
LABELS = ("", ',le="0.5"', ',le="+Inf"')
KEYS = (*(f'{name}{{engine="{e}"{extra}}}' for name in NAMES for e in (0, 1) for extra in LABELS), "vllm:plain")

floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
values = st.one_of(floats, floats, floats, st.none(), st.integers(-10**20, 10**20))
scrape = st.dictionaries(st.sampled_from(KEYS), values, max_size=12)


def _bits(value: Any) -> Any:
    return ("f", struct.pack("<d", value)) if type(value) is float else (type(value).__name__, value)


@settings(max_examples=400, deadline=None)
@given(samples=scrape)
def test_a_compact_scrape_reads_as_its_dict(samples: dict[str, Any]) -> None:
    held = Layouts().compact(samples)
    if not samples or {type(v) for v in samples.values()} != {float}:
        assert held is samples  # None or an integer among them (or nothing): the dict kept as it is
        return
    assert isinstance(held, Samples)
    assert list(held) == list(samples) and len(held) == len(samples)
    assert [(k, _bits(v)) for k, v in held.items()] == [(k, _bits(v)) for k, v in samples.items()]
    assert [_bits(v) for v in held.values()] == [_bits(v) for v in samples.values()]
    assert all(_bits(held[k]) == _bits(v) and k in held for k, v in samples.items())
    assert "vllm:never" not in held


def _reference_total(samples: dict[str, Any], name: str, match: dict[str, str] | None) -> Any:
    """The series' sum as the index summed the dict: keys with a value, in the scrape's order."""
    found = [(split_key(k)[1], v) for k, v in samples.items() if v is not None and split_key(k)[0] == name]
    if not found:
        return None
    return sum(v for labels, v in found if not match or match.items() <= labels.items())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return type(a) is type(b) and _bits(a) == _bits(b)


@settings(max_examples=300, deadline=None)
@given(scrapes=st.lists(scrape, min_size=1, max_size=6), compact=st.booleans())
def test_the_index_sums_each_series_as_the_dicts_did(scrapes: list[dict[str, Any]], compact: bool) -> None:
    layouts = Layouts()  # one run's layouts: scrapes with the same keys share one
    lines = [{"ts": float(n), "source": "s", "ok": True, "vllm_series": 1,
              "samples": layouts.compact(dict(s)) if compact else dict(s)} for n, s in enumerate(scrapes)]
    index = MetricIndex(lines)
    assert [s.ts for s in index.scrapes] == [float(n) for n in range(len(scrapes))]
    for name in ("vllm:a_total", "vllm:h_bucket", "vllm:h_count", "vllm:plain", "vllm:missing"):
        for match in (None, {"engine": "1"}, {"le": "+Inf"}, {"engine": "0", "le": "0.5"}):
            got = index.points(name, -1.0, 1e9, match, source="s")
            want = [(float(n), t) for n, s in enumerate(scrapes)
                    if (t := _reference_total(s, name, match)) is not None]
            assert [ts for ts, _ in got] == [ts for ts, _ in want]
            assert all(_same(g, w) for (_, g), (_, w) in zip(got, want, strict=True)), (name, match, got, want)


def test_scrapes_whose_keys_never_repeat_are_still_read_and_the_memory_of_them_is_bounded(monkeypatch) -> None:
    """A server whose series change at every scrape (a label per request): each scrape its own layout, past the
    bound none remembered, every value read back."""
    from k3load.analysis.run import scrape_samples

    monkeypatch.setattr(scrape_samples, "MAX_LAYOUTS", 3)
    layouts = Layouts()
    held = [layouts.compact({f'vllm:x{{id="{n}"}}': float(n), "vllm:y": 1.5}) for n in range(10)]
    assert len(layouts._layouts) == 3
    assert [dict(h.items()) for h in held] == [{f'vllm:x{{id="{n}"}}': float(n), "vllm:y": 1.5} for n in range(10)]
