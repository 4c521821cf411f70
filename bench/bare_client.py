"""The bare k3load client under load, as a process of its own: N ChatClients sending back to back.

Why a process: bench/peers.py measures every client as a process tree from /proc, the same way for
k3load and its peers. Gevent-patched first, as under Locust; one ChatClient per stream (as one per
Locust user), no validation, no records: what `k3load.client` alone costs. At the end it writes, for
every answer that came back whole, its first token's write time (the server's stamp in the text)
and the client's `first_token_ts`, both epoch seconds. SIGTERM (the bench has measured it) stops
it early: no new request starts, those in flight end (bounded), the results are written.

    .venv/bin/python bench/bare_client.py URL --streams 16 --tokens 128 --duration-s 20 --out FILE
"""

from __future__ import annotations

from gevent import monkey

monkey.patch_all()  # before anything imports socket/ssl: the client runs as under Locust

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent  # noqa: E402
import gevent.event  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# a baseline tree (bench/peers.py --baseline) first: its k3load is the one measured
sys.path.insert(0, os.environ.get("K3LOAD_BENCH_ROOT") or str(Path(__file__).resolve().parents[1]))

from bench.paced_server import stamp  # noqa: E402
from k3load.client.chat import ChatClient  # noqa: E402
from k3load.client.result import StreamResult  # noqa: E402


def run(url: str, streams: int, tokens: int, duration_s: float, max_requests: int) -> list[StreamResult]:
    """Every stream sends until `duration_s` has passed or `max_requests` were sent in all (bounded)."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    clients = [ChatClient(url, max_connections=1) for _ in range(streams)]
    results: list[StreamResult] = []
    end = time.monotonic() + duration_s
    stopping = gevent.event.Event()
    gevent.signal_handler(signal.SIGTERM, stopping.set)  # the bench measured us: stop, then write

    def user(client: ChatClient) -> None:
        while time.monotonic() < end and len(results) < max_requests and not stopping.is_set():
            results.append(client.send(body, 60.0, stream=True))

    users = [gevent.spawn(user, c) for c in clients]
    stopping.wait(duration_s)
    gevent.joinall(users, timeout=70)  # requests in flight end (their first tokens may be in the interval)
    gevent.killall(users, timeout=5)
    for client in clients:
        client.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--duration-s", type=float, required=True)
    parser.add_argument("--max-requests", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import k3load.client.chat

    print(f"k3load from {Path(k3load.client.chat.__file__).parents[2]}", flush=True)
    results = run(args.url, args.streams, args.tokens, args.duration_s, args.max_requests)
    pairs = [(stamp(r.content), r.first_token_ts) for r in results if r.status == "ok"]
    args.out.write_text(json.dumps({"requests": len(results), "ok": len(pairs),
                                    "first_tokens": [p for p in pairs if p[0] is not None and p[1] is not None]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
