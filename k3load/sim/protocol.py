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


def context_length_message(max_model_len: int) -> str:
    """vLLM 0.32 counts the prompt only up to max_model_len + 1 tokens, so it says 'at least'."""
    over = max_model_len + 1
    return (f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains at "
            f"least {over} input tokens, which exceeds this limit even without any output tokens. Please reduce "
            f"the length of the input prompt. (parameter=input_tokens, value={over})")


def validation_error(kind: str, loc: str, msg: str, items: int, ctx: str = "") -> ApiError:
    """FastAPI/pydantic request-validation errors as vLLM words them (type 'Bad Request')."""
    extra = f", 'ctx': {{'error': '{ctx}'}}" if ctx else ""
    message = (f"1 validation error:\n  {{'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}', "
               f"'input': '<dict of {items} items>'{extra}}}")
    return ApiError(400, message, "Bad Request", loc)


class ChunkWriter:
    """Builds the `chat.completion.chunk` objects of one streamed response, in vLLM's order."""

    def __init__(self, model: str, version: str, named_tool: bool = False, has_tools: bool = False,
                 request_id: str | None = None) -> None:
        # vLLM takes an incoming X-Request-Id as the request's id (vllm 0.32: `_base_request_id` in
        # entrypoints/serve/engine/serving.py; chat_completion/serving.py builds `chatcmpl-<it>`)
        self.id = f"chatcmpl-{request_id if request_id is not None else uuid.uuid4().hex[:16]}"
        self.created = int(time.time())
        self.model = model
        self.fingerprint = f"vllm-{version}-k3loadsim"
        self.named_tool = named_tool  # vLLM: named tool_choice finishes "stop", argument deltas carry no name
        self.has_tools = has_tools

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def role(self) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""}
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
                           prompt_token_ids=None, prompt_text=None)

    def delta(self, piece: Piece, plan: OutputPlan) -> dict[str, Any] | None:
        """The delta for one generated piece, or None when the parser holds it back."""
        delta = piece_delta(piece, plan, self.named_tool)
        if delta is None:
            return None
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None,
                             "token_ids": None}])

    def finish(self, finish_reason: str, piece: Piece, plan: OutputPlan) -> dict[str, Any]:
        """vLLM sends the last token's delta in the same chunk as finish_reason ({} if it adds nothing)."""
        delta = piece_delta(piece, plan, self.named_tool) or {}
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                             "stop_reason": None, "token_ids": None}])

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Streamed usage leaves out null fields (as vLLM does)."""
        details = {k: v for k, v in (usage.get("prompt_tokens_details") or {}).items() if v is not None}
        body = {k: v for k, v in usage.items() if v is not None and k != "prompt_tokens_details"}
        if details:
            body["prompt_tokens_details"] = details
        return self._chunk([], usage=body, system_fingerprint=self.fingerprint)


def piece_delta(piece: Piece, plan: OutputPlan, named_tool: bool = False) -> dict[str, Any] | None:
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
        function = {"arguments": piece.text} if named_tool else {"name": None, "arguments": piece.text}
        return {"tool_calls": [{"index": piece.tool_index, "function": function}]}
    if piece.kind == "tool_empty":  # a streaming parser that lost the call (vllm#54701)
        return {"tool_calls": []}
    return None


def assemble_message(plan: OutputPlan, pieces: list[Piece], writer: ChunkWriter) -> dict[str, Any]:
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
    message: dict[str, Any] = {"role": "assistant", "content": content or ("" if writer.named_tool else None),
                               "refusal": None, "annotations": None, "audio": None, "function_call": None}
    if writer.has_tools:
        message["tool_calls"] = list(calls.values())
    message["reasoning"] = reasoning or None
    return message


def completion(writer: ChunkWriter, plan: OutputPlan, pieces: list[Piece], usage: dict[str, Any]
               ) -> dict[str, Any]:
    return {"id": writer.id, "object": "chat.completion", "created": writer.created, "model": writer.model,
            "choices": [{"index": 0, "message": assemble_message(plan, pieces, writer), "logprobs": None,
                         "finish_reason": plan.finish_reason, "stop_reason": None, "token_ids": None,
                         "routed_experts": None}],
            "service_tier": None, "system_fingerprint": writer.fingerprint, "usage": usage,
            "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None}


def usage_body(prompt: int, completion_tokens: int, cache: tuple[int, int] | None, reasoning: int | None
               ) -> dict[str, Any]:
    """`cache` is (cached_tokens, created_cache_tokens) when prompt-token details are enabled."""
    body: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion_tokens,
                            "completion_tokens": completion_tokens, "prompt_tokens_details": None,
                            "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None}
    if cache is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cache[0], "created_cache_tokens": cache[1],
                                         "multimodal_tokens": None}
    return body
