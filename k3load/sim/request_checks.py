"""Request validation with vLLM's status codes and messages (serving_chat.py, serving_engine.py).

Why: the harness attributes a 400 to the request (client layer) and a 5xx to the server; the sim
must refuse the same requests a real vLLM refuses, with the same bodies.
"""

from __future__ import annotations

from typing import Any

from k3load.sim.config import SimConfig
from k3load.sim.protocol import ApiError, context_length_message


def _tool_names(body: dict[str, Any]) -> list[str]:
    return [t.get("function", {}).get("name", "") for t in body.get("tools") or []]


def validate_request(body: Any, config: SimConfig) -> None:
    """Raise ApiError for a request vLLM would reject before scheduling."""
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != config.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "Field required: messages must be a non-empty list", param="messages")
    if body.get("stream_options") and not body.get("stream"):
        raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    _check_tool_choice(body)


def _check_tool_choice(body: dict[str, Any]) -> None:
    choice = body.get("tool_choice")
    names = _tool_names(body)
    if choice in (None, "none", "auto"):
        return
    if choice == "required":
        if not names:
            raise ApiError(400, 'When using `tool_choice`, `tools` must be set.', param="tool_choice")
        return
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise ApiError(400, f"Tool '{name}' has not been passed in `tools`.", param="tool_choice")
        return
    raise ApiError(400, f"Invalid tool_choice: {choice!r}", param="tool_choice")


def effective_max_tokens(body: dict[str, Any], prompt_tokens: int, config: SimConfig) -> int:
    """Refuse prompts over the context (vLLM's exact 400); clamp max_tokens to what is left."""
    if prompt_tokens >= config.max_model_len:
        raise ApiError(400, context_length_message(config.max_model_len, prompt_tokens), param="input_tokens")
    room = config.max_model_len - prompt_tokens
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    if asked is not None and asked > config.max_model_len:
        raise ApiError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's "
                       f"maximum context length is {config.max_model_len} tokens and your request has "
                       f"{prompt_tokens} input tokens ({asked} > {config.max_model_len} - {prompt_tokens}).",
                       param="max_tokens")
    return min(asked or room, room)
