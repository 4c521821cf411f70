"""Record the sim's wire output that the real vLLM captures lack: K3 whole-call tool deltas, K2 split
deltas of the same answer, reasoning, a mid-stream error event and a cut stream.

Why recorded and not generated in each test: the decoder and assembler tests read bytes from disk,
exactly like the real-vLLM captures next door, with no server running. Re-record with
`.venv/bin/python tests/data/wire/sim/record.py` after a change to the sim's wire format.
Files: NAME.sse (raw SSE body) + NAME.meta.json ({sim_args, request, status, headers}), and
NAME.json ({sim_args, request, status, headers, body}) for non-streamed answers.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import httpx

from k3load.sim.process import SimProcess

HERE = Path(__file__).parent

BASE = ["--time-scale", "0.05", "--model", "tiny", "--max-model-len", "2048", "--seed", "7"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_REQUEST = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "max_tokens": 128, "stream": True,
                "stream_options": {"include_usage": True}}
NAMED = {**TOOL_REQUEST, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
TEXT = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello in French"}], "max_tokens": 64,
        "stream": True, "stream_options": {"include_usage": True}}
# name -> (extra sim args, request)
CAPTURES: dict[str, tuple[list[str], dict[str, Any]]] = {
    "k3_tool_auto": (["--tool-call-style", "k3"], TOOL_REQUEST),
    "k2_tool_auto": (["--tool-call-style", "k2"], TOOL_REQUEST),
    "k3_tool_named": (["--tool-call-style", "k3"], NAMED),
    "k2_tool_named": (["--tool-call-style", "k2"], NAMED),
    "k3_text_reasoning": ([], TEXT),
    "midstream_error": (["--midstream-error-rate", "1"], TEXT),
    "truncated": (["--truncate-stream-rate", "1"], TEXT),
    "nonstream_k3_tool": (["--tool-call-style", "k3"], {**TOOL_REQUEST, "stream": False, "stream_options": None}),
}


def record(name: str, sim_args: list[str], request: dict[str, Any], log_dir: Path) -> None:
    """One fresh sim per capture: the sim's answers depend on what it has already seen."""
    with SimProcess([*BASE, *sim_args], log_dir / f"{name}.log") as sim, httpx.Client(timeout=30) as client:
        url = f"{sim.base_url}/v1/chat/completions"
        with client.stream("POST", url, json=request) as resp:
            raw = bytearray()
            try:
                for block in resp.iter_raw():
                    raw += block
            except httpx.RemoteProtocolError:
                pass  # the truncated capture: keep what arrived
            headers = {k: v for k, v in resp.headers.items() if k not in ("date",)}
            meta = {"sim_args": [*BASE, *sim_args], "request": request, "status": resp.status_code,
                    "headers": headers}
    if request.get("stream"):
        (HERE / f"{name}.sse").write_bytes(bytes(raw))
        (HERE / f"{name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    else:
        meta["body"] = json.loads(raw)
        (HERE / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, (sim_args, request) in CAPTURES.items():
            record(name, sim_args, request, Path(tmp))
            print("recorded", name)


if __name__ == "__main__":
    main()
