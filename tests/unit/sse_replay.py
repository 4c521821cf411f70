"""What the SSE decoder and assembler tests share: feed recorded bytes through the decoder at chosen cuts,
assemble the events, and read the result as a StreamResult. One copy, so the decoder's tests and the
assembler's read a recording the same way."""

from __future__ import annotations

from pathlib import Path

from k3load.client.assemble import Assembler
from k3load.client.result import StreamResult
from k3load.client.sse import DONE, SSEDecoder, SSEEvent

SIM_WIRE = Path(__file__).parents[1] / "data" / "wire" / "sim"


def decode(raw: bytes, cuts: list[int] | None = None) -> list[SSEEvent]:
    """Feed `raw` split at `cuts` (byte offsets), then finish."""
    decoder, events, start = SSEDecoder(), [], 0
    for cut in [*(cuts or []), len(raw)]:
        events += decoder.feed(raw[start:cut])
        start = cut
    return events + decoder.finish()


def assemble(events: list[SSEEvent]) -> tuple[Assembler, int]:
    """(assembler, number of token-bearing chunks)."""
    asm = Assembler()
    tokens = sum(bool(asm.add(e)) for e in events if e is not DONE)  # type: ignore[arg-type]
    return asm, tokens


def snapshot(asm: Assembler) -> StreamResult:
    result = StreamResult(status="ok", transport="none", send_ts=0.0, end_ts=0.0)
    asm.fill(result)
    return result

