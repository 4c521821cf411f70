"""A /metrics scrape's samples held as one array of floats over a key layout that the run's scrapes share.

Why: a vLLM scrape carries about 360 series, and a run scrapes at 1 Hz. Held as a dict per scrape (the
keys shared, each value a boxed float), an hour's scrapes took 90 MB and the index of them beside that
41 MB: about 3 GB for a day's soak, more than issue 31's whole budget for judging a day. Nearly every
scrape of a run carries the same keys in the same order, so the keys, their parsed labels and each series
name's place are kept once (`SampleLayout`), and a scrape keeps only its floats (8 bytes each, `Samples`).

The values are grouped by series name (the names in order of first appearance, each name's keys in the
scrape's order), so a name's values are one contiguous slice: `MetricIndex` sums a slice in the order
the scrape listed them, the same additions as over the dict's values, so the same floats to the bit.
`Samples` reads as the dict it replaces (`Mapping`, iterated in the scrape's order). A scrape with a value
that is not a float (None where the sampler had none, or an integer from another writer) keeps its plain
dict: the index then takes its float-valued keys from a layout of those alone (`index_layout`), and its
values as they were (so an integer sums as an integer, as before).
"""

from __future__ import annotations

from array import array
from collections.abc import ItemsView, Iterator, Mapping, Sequence, ValuesView
from operator import itemgetter
from typing import Any

from k3load.sampler.prom import split_key

Labels = tuple[dict[str, str], ...]


class SampleLayout:
    """The keys of a scrape in its order; each series name's labels and slice of the grouped values."""

    __slots__ = ("_in_scrape_order", "_to_grouped", "keys", "series", "slot")

    def __init__(self, keys: tuple[str, ...], parsed: dict[str, tuple[str, dict[str, str]]]) -> None:
        self.keys = keys
        by_name: dict[str, list[int]] = {}
        for position, key in enumerate(keys):
            by_name.setdefault(parsed[key][0], []).append(position)
        grouped = [position for positions in by_name.values() for position in positions]
        self.slot = {keys[position]: at for at, position in enumerate(grouped)}  # key -> its place in the values
        self.series: dict[str, tuple[Labels, int, int]] = {}  # name -> (labels in scrape order, start, stop)
        start = 0
        for name, positions in by_name.items():
            stop = start + len(positions)
            self.series[name] = (tuple(parsed[keys[p]][1] for p in positions), start, stop)
            start = stop
        order = [self.slot[key] for key in keys]
        # itemgetter of one place gives the item, not a 1-tuple: a one-key layout is read whole instead
        self._in_scrape_order = itemgetter(*order) if len(order) > 1 else None
        self._to_grouped = itemgetter(*grouped) if len(grouped) > 1 else None

    def grouped(self, values: Sequence[Any]) -> tuple[Any, ...]:
        """Values given in the scrape's order, in this layout's grouped order."""
        return tuple(values) if self._to_grouped is None else self._to_grouped(values)

    def in_scrape_order(self, values: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(values) if self._in_scrape_order is None else self._in_scrape_order(values)


MAX_LAYOUTS = 4_096  # distinct key sequences remembered: past that (a server whose series churn), one per scrape


class Layouts:
    """One layout per distinct key sequence of a run (and each key parsed once), shared by its scrapes. A run
    sees a few (a series appears when its first event does: a `finished_reason` of `abort`, an adapter); a
    server whose keys change at every scrape gets a layout per scrape, about what a dict per scrape held."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[str, ...], SampleLayout] = {}
        self._parsed: dict[str, tuple[str, dict[str, str]]] = {}

    def of(self, keys: tuple[str, ...]) -> SampleLayout:
        layout = self._layouts.get(keys)
        if layout is None:
            parsed = self._parsed
            if len(parsed) > MAX_LAYOUTS * 64:  # keys that never repeat: parsed for this scrape only
                parsed = {key: parsed.get(key) or split_key(key) for key in keys}
            for key in keys:
                if key not in parsed:
                    parsed[key] = split_key(key)
            layout = SampleLayout(keys, parsed)
            if len(self._layouts) < MAX_LAYOUTS:
                self._layouts[keys] = layout
        return layout

    def compact(self, samples: Any) -> Any:
        """`samples` as `Samples` where every value is a float (the sampler's scrapes); anything else as it is."""
        if not isinstance(samples, dict) or not samples:
            return samples
        values = tuple(samples.values())
        if set(map(type, values)) != {float}:
            return samples
        layout = self.of(tuple(samples))
        return Samples(layout, array("d", layout.grouped(values)))

    def index_view(self, samples: Any) -> tuple[SampleLayout, Sequence[float]] | None:
        """What `MetricIndex` reads of a scrape's samples: the layout of its keys with a value and the values in
        the layout's grouped order (None when it has none). A `Samples` is read as it is held."""
        if isinstance(samples, Samples):
            return samples.layout, samples.floats
        if not isinstance(samples, dict):
            return None
        kept = {key: value for key, value in samples.items() if value is not None}
        if not kept:
            return None
        layout = self.of(tuple(kept))
        return layout, layout.grouped(tuple(kept.values()))


class _Items(ItemsView[str, float]):
    """Iterated in one step (the scrape's order picked from the values at once), not a lookup per key."""

    def __init__(self, samples: Samples) -> None:
        super().__init__(samples)
        self._samples = samples

    def __iter__(self) -> Iterator[tuple[str, float]]:
        layout = self._samples.layout
        return zip(layout.keys, layout.in_scrape_order(self._samples.floats), strict=True)


class _Values(ValuesView[float]):
    def __init__(self, samples: Samples) -> None:
        super().__init__(samples)
        self._samples = samples

    def __iter__(self) -> Iterator[float]:
        return iter(self._samples.layout.in_scrape_order(self._samples.floats))


class Samples(Mapping[str, float]):
    """One scrape's samples: the dict `{key: value}` it was, read through its layout (equality and no hash:
    `Mapping`'s own, as a dict's)."""

    __slots__ = ("floats", "layout")

    def __init__(self, layout: SampleLayout, floats: array[float]) -> None:
        self.layout = layout
        self.floats = floats  # in the layout's grouped order

    def __getitem__(self, key: str) -> float:
        return self.floats[self.layout.slot[key]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.keys)

    def __len__(self) -> int:
        return len(self.layout.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.layout.slot

    def items(self) -> ItemsView[str, float]:
        return _Items(self)

    def values(self) -> ValuesView[float]:
        return _Values(self)
