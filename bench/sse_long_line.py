"""CPU cost of one very long SSE line fed in 64 KiB reads: the decoder must be linear in its input.

Why: a server (or proxy) that sends a 50 MB line once cost 14-21 s of CPU in a decoder that re-joined
and re-split the unfinished line on every read (quadratic), starving every other request in the
process. Prints, for a 2 MB and a 20 MB line: the decoder's CPU time, the same for the former
re-join-per-read algorithm (replicated here as the reference, measured in the same run), and a plain
join + split of the same bytes once (the least any decoder must do). Linear: ratio about 10x (more
where 2 MB still fits in the CPU cache and 20 MB does not: the floor shows how much; from 20 to 40 MB,
both out of cache, about 2x); quadratic: 100x.

    .venv/bin/python bench/sse_long_line.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from k3load.client.sse import SSEDecoder

READ_BYTES = 64 << 10


def pieces(line_bytes: int) -> list[bytes]:
    raw = b'data: {"content": "' + b"x" * line_bytes + b'"}\n\ndata: [DONE]\n\n'
    return [raw[i:i + READ_BYTES] for i in range(0, len(raw), READ_BYTES)]


def decoder_now(reads: list[bytes]) -> None:
    decoder = SSEDecoder(max_line_bytes=64 << 20)
    for data in reads:
        decoder.feed(data)


def decoder_before(reads: list[bytes]) -> None:
    """The framing loop of the decoder before the fix: the tail re-joined with each read, re-split."""
    tail = b""
    for data in reads:
        lines = (tail + data).split(b"\n")
        tail = lines.pop()


def floor(reads: list[bytes]) -> None:
    b"".join(reads).split(b"\n")


def cpu_s(fn: Callable[[list[bytes]], None], reads: list[bytes], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        fn(reads)
        best = min(best, time.process_time() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per figure")
    args = parser.parse_args()
    small, big, bigger = pieces(2 << 20), pieces(20 << 20), pieces(40 << 20)
    print(f"one SSE line in {READ_BYTES >> 10} KiB reads; CPU seconds, best of {args.repeats}")
    print(f"{'':28}{'2 MB':>9}{'20 MB':>9}{'ratio':>8}{'40 MB':>9}{'40/20':>7}")
    for name, fn in (("decoder (now)", decoder_now), ("re-join per read (before)", decoder_before),
                     ("join + split once (floor)", floor)):
        a, b = cpu_s(fn, small, args.repeats), cpu_s(fn, big, args.repeats)
        row = f"{name:28}{a:9.4f}{b:9.4f}{b / a:7.1f}x"
        if fn is not decoder_before:  # the quadratic one would take about 4x the 20 MB time
            c = cpu_s(fn, bigger, args.repeats)
            row += f"{c:9.4f}{c / b:6.1f}x"
        print(row)

if __name__ == "__main__":
    main()
