"""What one HTTP attempt produced, before any validation: the client's only output type.

Why separate from the record: the client knows nothing of scenarios, stages or retries; the runner
adds those and the validation findings to make an Attempt record. Times are wall-clock epoch seconds
(`*_ts`) so they join with the sampler's timelines; durations carry their unit; unknown is None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# How an attempt ended, as far as transport goes (the validation layer is judged later).
STATUS_OK = "ok"  # complete response ([DONE] seen, or a complete JSON body)
STATUS_HTTP_ERROR = "http_error"  # non-2xx status; body kept
STATUS_STREAM_ERROR = "stream_error"  # `data: {"error": ...}` mid-stream
STATUS_TRUNCATED = "truncated"  # the stream ended without [DONE] (connection closed, cut body)
STATUS_MALFORMED = "malformed"  # bytes that are not SSE/JSON where they must be
STATUS_TIMEOUT = "timeout"  # our own hard deadline passed
STATUS_TRANSPORT_ERROR = "transport_error"  # connect refused, reset, DNS ...
# The client itself raised before it could say how the exchange ended: nothing is known of the answer (the
# record's `harness.error` finding names the exception; k3load.workload.harness_error). Never the server's.
STATUS_CLIENT_RAISED = "client_raised"
STATUSES = (STATUS_OK, STATUS_HTTP_ERROR, STATUS_STREAM_ERROR, STATUS_TRUNCATED, STATUS_MALFORMED,
            STATUS_TIMEOUT, STATUS_TRANSPORT_ERROR, STATUS_CLIENT_RAISED)


@dataclass
class ToolCall:
    """A tool call as reassembled from deltas (K2 split arguments or K3 whole-call deltas)."""

    index: int
    id: str | None
    name: str | None
    arguments: str  # raw text as received; parsing it is validation's job

    def as_message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class StreamResult:
    """One attempt as the client saw it."""

    status: str
    transport: str
    send_ts: float
    end_ts: float
    first_byte_ts: float | None = None
    first_token_ts: float | None = None  # first chunk adding reasoning, content or a tool call
    # First chunk adding content or a tool-call part (not reasoning): what a user of an agent waits for.
    # The same as first_token_ts when the answer did not think first; None when nothing but reasoning
    # came, and when not streamed.
    first_answer_ts: float | None = None
    chunk_ts: list[float] = field(default_factory=list)  # arrival of every token-bearing chunk
    # Indices into chunk_ts of the chunks that added a tool-call part (an id, a name or argument text):
    # one per argument piece when a parser streams a call (K2), one per call when it holds each call
    # back until it is whole (K3, vllm#50604). Empty for a non-streamed answer.
    tool_chunk_idx: list[int] = field(default_factory=list)
    # Arrival of the stream's first SSE data event: vLLM's role chunk (`"role": "assistant",
    # "content": ""`), sent once prefill is done and the first token is out, so the silence before a
    # first token-bearing chunk is measured from the end of prefill. None when not streamed (or no event).
    first_event_ts: float | None = None
    http_status: int | None = None
    error: str | None = None  # one line: what went wrong
    error_body: str | None = None  # the server's body (truncated), for attribution
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    response_id: str | None = None
    usage: dict[str, Any] | None = None  # exactly as the server reported it
    retry_after_s: float | None = None  # an HTTP error's Retry-After, in seconds from its arrival
    # A stream ends at [DONE] (end_ts is its read's time): body bytes after it, counted (those that came
    # with it or during the brief wait for the message's end, never waited for longer), and whether the
    # body was still open then (its connection closed, not reused). None: no [DONE], or not streamed.
    after_done_bytes: int | None = None
    after_done_open: bool | None = None
    # How the stream's body reached the client: the socket reads that carried it up to [DONE] and their
    # bytes. A server that writes each SSE event as it decodes arrives about one event per read; a proxy
    # that buffers the stream (nginx's default `proxy_buffering on`) delivers it in a few buffer-sized
    # blocks, many events per read and the first one late (analysis/pillars/headroom/buffering.py). None when not
    # streamed.
    stream_reads: int | None = None
    stream_bytes: int | None = None

    @property
    def prompt_tokens(self) -> int | None:
        return (self.usage or {}).get("prompt_tokens")

    @property
    def completion_tokens(self) -> int | None:
        return (self.usage or {}).get("completion_tokens")

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens")

    @property
    def reasoning_tokens(self) -> int | None:
        details = (self.usage or {}).get("completion_tokens_details") or {}
        return details.get("reasoning_tokens")
