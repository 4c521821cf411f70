"""JSON shapes the sim writes, matched to vLLM's OpenAI server (vllm/entrypoints/openai/protocol.py).

Why one module: the conformance suite compares these shapes against a real vLLM; keeping every
body in one place makes a mismatch a one-line fix. Error bodies follow vLLM's ErrorResponse.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from k3load.sim.generate import OutputPlan, Piece


class ApiError(Exception):
    """An error answered with vLLM's error body."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.err_type, self.param)


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def context_length_message(max_model_len: int, prompt_tokens: int) -> str:
    return (f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.")


class ChunkWriter:
    """Builds the `chat.completion.chunk` objects of one streamed response, in vLLM's order."""

    def __init__(self, model: str, request_id: str | None = None) -> None:
        self.id = request_id or f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def role(self) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""}
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
                           prompt_token_ids=None)

    def delta(self, piece: Piece, plan: OutputPlan) -> dict[str, Any] | None:
        """The delta for one generated piece, or None when the parser holds it back."""
        delta = piece_delta(piece, plan)
        if delta is None:
            return None
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None,
                             "token_ids": None}])

    def finish(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason,
                             "stop_reason": None, "token_ids": None}])

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._chunk([], usage=usage)


def piece_delta(piece: Piece, plan: OutputPlan) -> dict[str, Any] | None:
    if piece.kind == "reasoning":
        return {"reasoning": piece.text}
    if piece.kind == "content":
        return {"content": piece.text}
    if piece.kind in ("tool_header", "tool_whole"):
        call = plan.tool_calls[piece.tool_index]
        arguments = piece.text if piece.kind == "tool_whole" else ""
        return {"tool_calls": [{"id": call["id"], "type": "function", "index": piece.tool_index,
                                "function": {"name": call["name"], "arguments": arguments}}]}
    if piece.kind == "tool_args":
        return {"tool_calls": [{"index": piece.tool_index, "function": {"arguments": piece.text}}]}
    return None


def assemble_message(plan: OutputPlan, pieces: list[Piece]) -> dict[str, Any]:
    """The non-streaming `message`: what the pieces add up to."""
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    content = "".join(p.text for p in pieces if p.kind == "content")
    calls: dict[int, dict[str, Any]] = {}
    for p in pieces:
        if p.kind in ("tool_header", "tool_whole"):
            meta = plan.tool_calls[p.tool_index]
            calls[p.tool_index] = {"id": meta["id"], "type": "function",
                                   "function": {"name": meta["name"], "arguments": p.text}}
        elif p.kind == "tool_args" and p.tool_index in calls:
            calls[p.tool_index]["function"]["arguments"] += p.text
    return {"role": "assistant", "content": content or None, "refusal": None, "annotations": None,
            "audio": None, "function_call": None, "tool_calls": list(calls.values()),
            "reasoning": reasoning or None}


def completion(writer: ChunkWriter, plan: OutputPlan, pieces: list[Piece], usage: dict[str, Any]
               ) -> dict[str, Any]:
    return {"id": writer.id, "object": "chat.completion", "created": writer.created, "model": writer.model,
            "choices": [{"index": 0, "message": assemble_message(plan, pieces), "logprobs": None,
                         "finish_reason": plan.finish_reason, "stop_reason": None, "token_ids": None}],
            "service_tier": None, "system_fingerprint": None, "usage": usage,
            "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None}


def usage_body(prompt: int, completion_tokens: int, cached: int | None, reasoning: int | None
               ) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion_tokens,
                            "completion_tokens": completion_tokens}
    if cached is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return body
