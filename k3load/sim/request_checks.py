"""Request validation with vLLM's status codes and messages (serving_chat.py, serving_engine.py).

Why: the harness attributes a 400 to the request (client layer) and a 5xx to the server; the sim
must refuse the same requests a real vLLM refuses, with the same bodies.
"""

from __future__ import annotations

from typing import Any

from k3load.sim.config import SimConfig
from k3load.sim.protocol import ApiError, context_length_message, validation_error


def _tool_names(body: dict[str, Any]) -> list[str]:
    return [t.get("function", {}).get("name", "") for t in body.get("tools") or []]


def validate_request(body: Any, config: SimConfig) -> None:
    """Raise ApiError for a request vLLM would reject before scheduling."""
    if not isinstance(body, dict):
        raise validation_error("model_attributes_type", "body", "Input should be a valid dictionary", 0)
    messages = body.get("messages")
    if "messages" not in body:
        raise validation_error("missing", "body.messages", "Field required", len(body))
    if not isinstance(messages, list) or not messages:
        raise validation_error("list_type", "body.messages", "Input should be a non-empty list", len(body))
    model = body.get("model")
    if model is not None and model != config.model:
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {config.model}.",
                       "NotFoundError", "model")
    if body.get("stream_options") and not body.get("stream"):
        raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}. (parameter=max_tokens, "
                       f"value={max_tokens})", param="max_tokens")
    _check_min_tokens(body.get("min_tokens"), max_tokens)
    _check_tool_choice(body)


def _check_min_tokens(min_tokens: Any, max_tokens: Any) -> None:
    """vLLM's SamplingParams._verify_args (vllm/sampling_params.py): min_tokens at or above 0 and at most
    max_tokens; a 400 before scheduling."""
    if min_tokens is None:
        return
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0:
        raise ApiError(400, f"min_tokens must be greater than or equal to 0, got {min_tokens}.", param="min_tokens")
    if isinstance(max_tokens, int) and min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
                       param="min_tokens")


def _check_tool_choice(body: dict[str, Any]) -> None:
    choice = body.get("tool_choice")
    names = _tool_names(body)
    if choice in (None, "none", "auto"):
        return
    if not names:
        raise ApiError(400, "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)",
                       param="tool_choice")
    if choice == "required":
        return
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise ApiError(400, f"Tool '{name}' has not been passed in `tools`. (parameter=tool_choice)",
                           param="tool_choice")
        return
    raise ApiError(400, f"Invalid tool_choice: {choice!r}", param="tool_choice")


def effective_max_tokens(body: dict[str, Any], prompt_tokens: int, config: SimConfig) -> int:
    """Refuse prompts over the context (vLLM's exact 400); clamp max_tokens to what is left."""
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    limit = config.max_model_len
    if asked is not None and asked > limit:
        raise ApiError(400, f"max_tokens={asked} cannot be greater than max_model_len={limit}. Please request "
                       f"fewer output tokens. (parameter=max_tokens, value={asked})", param="max_tokens")
    if prompt_tokens >= limit:
        raise ApiError(400, context_length_message(limit), param="input_tokens")
    room = limit - prompt_tokens
    return min(asked or room, room)  # prompt + max_tokens over the context: cut with finish 'length'
