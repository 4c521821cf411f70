"""The two GPU pollers behind gpu.jsonl: NVML on this host and one dcgm-exporter URL per node.

Why each says "unavailable" once and then stays quiet: a CPU-only rehearsal (or a node without the
exporter) is normal and must be stated clearly in the run directory, but a line per second saying so
would bury the timeline; a reading that is missing is absent, never a row of zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from k3load.events import Event, EventSink
from k3load.sampler.dcgm import dcgm_rows
from k3load.sampler.fetch import Fetched, redact_url
from k3load.sampler.nvml import NvmlReader, load
from k3load.sampler.prom import parse

GpuSink = Callable[[list[dict[str, Any]]], None]


class NvmlPoller:
    """Local GPUs through NVML; `nvml` is "auto" (the real pynvml) or an injected library."""

    name = "nvml"

    def __init__(self, nvml: Any, sink: GpuSink, event: EventSink, clock: Callable[[], float]) -> None:
        self._sink, self._event = sink, event
        self.reader: NvmlReader | None = None
        lib, reason = load(nvml)
        if lib is not None:
            self.reader = NvmlReader(lib)
            if not self.reader.handles:
                self.reader.close()
                self.reader, reason = None, "NVML initialised but reports no GPU"
        if self.reader is None:
            event(Event.GPU_UNAVAILABLE, clock(), source="nvml", reason=reason)
        else:
            event(Event.GPU_FOUND, clock(), source="nvml", node=self.reader.node, gpus=len(self.reader.handles),
                  names=[name for name, _uuid in self.reader.static])

    @property
    def available(self) -> bool:
        return self.reader is not None

    def tick(self, ts: float) -> None:
        if self.reader is not None:
            self._sink(self.reader.read(ts))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


class DcgmPoller:
    """One dcgm-exporter `/metrics`; down/up transitions and a missing-series notice as events."""

    def __init__(self, url: str, fetcher: Callable[[str], Fetched], sink: GpuSink, event: EventSink) -> None:
        self.url, self.source = url, redact_url(url)
        self.name = f"dcgm:{self.source}"
        self._fetch, self._sink, self._event = fetcher, sink, event
        self._down: str | None = None
        self._empty_said = False

    def tick(self, ts: float) -> None:
        result = self._fetch(self.url)
        error = result.error
        rows: list[dict[str, Any]] = []
        if result.ok:
            try:
                rows = dcgm_rows(parse(result.body).dcgm, ts, self.source)
            except ValueError as exc:
                error = f"parse error: {exc}"[:300]
        if error is not None:
            if self._down is None:
                self._event(Event.GPU_SOURCE_DOWN, ts, source=self.name, reason=error)
            self._down = error
            return
        if self._down is not None:
            self._event(Event.GPU_SOURCE_UP, ts, source=self.name)
            self._down = None
        if rows:
            self._sink(rows)
        elif not self._empty_said:
            self._empty_said = True
            self._event(Event.GPU_UNAVAILABLE, ts, source=self.name, reason="no DCGM_FI_* series at this URL")
