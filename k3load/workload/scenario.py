"""Load and validate agent scenario files (`scenarios/*.yaml`).

Why strict: a scenario is evidence. A misspelt key that silently fell back to a default would change
what was tested without anyone noticing, so unknown keys, bad JSON Schemas in tool definitions and
references to tools that do not exist are all load errors naming the file and the field.
The format is documented field by field in `k3load/schemas/scenario.schema.json` and docs/scenarios-and-plans.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from k3load.errors import InputError
from k3load.workload import logged
from k3load.workload.fallback import Fallback
from k3load.yamlfile import YamlFileError, read_yaml_file

DEFAULT_RETRY = {"max_attempts": 1, "backoff_s": 0.0,
                 "when": ["timeout", "http_429", "http_5xx", "transport_error", "truncated", "stream_error"]}
DEFAULT_SETTINGS: dict[str, Any] = {"max_tokens": 256, "timeout_s": 60.0, "temperature": 0.0, "stream": True}
TURN_SETTINGS = ("max_tokens", "timeout_s", "tool_choice", "response_format", "parallel_tool_calls", "retry")


class ScenarioError(InputError):
    """A scenario that cannot be used: the message names the file and the field."""


@dataclass(frozen=True)
class Turn:
    index: int
    expect: dict[str, Any]
    user: str | None = None
    reply: dict[str, Any] | None = None
    settings: dict[str, Any] = field(default_factory=dict)  # defaults merged with the turn's overrides
    # A logged turn (k3load.workload.logged): the messages it adds, its body's other keys as logged, the
    # answer the agent got (None: none was recorded)
    messages: tuple[dict[str, Any], ...] = ()
    request: dict[str, Any] | None = None
    recorded: dict[str, Any] | None = None
    # a logged turn's offered tools by name, their parameters normalised once at load (validated per answer)
    tool_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    # what the one attempt after exhausted retries is sent with (k3load.workload.retry_policy); None: no fallback
    fallback: Fallback | None = None

    @property
    def kind(self) -> str:
        return self.expect["kind"]

    @property
    def retry(self) -> dict[str, Any]:
        return self.settings["retry"]


@dataclass(frozen=True)
class Scenario:
    name: str
    family: str
    system_prompt: str
    turns: tuple[Turn, ...]
    path: Path
    description: str = ""
    mode: str = "conversation"
    prefix_salt: str = "none"
    context: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] = ()
    executors: dict[str, Any] = field(default_factory=dict)
    long_input: dict[str, Any] | None = None
    user_think_s: dict[str, float] | None = None  # the gap before a turn after an answer, open-loop only
    history: str | None = None  # scripted | model; None: as the plan says (default scripted)
    source: dict[str, Any] | None = None  # a logged scenario's origin (k3load import)

    @property
    def is_logged(self) -> bool:
        return self.mode == logged.LOGGED

    def tool_schema(self, name: str, turn: Turn | None = None) -> dict[str, Any] | None:
        """The parameter schema of tool `name` as the request offered it: a logged turn's own tools
        (normalised: k3load.workload.logged), else the scenario's."""
        if self.is_logged:
            if turn is not None:
                return turn.tool_schemas.get(name)
            return next((t.tool_schemas[name] for t in self.turns if name in t.tool_schemas), None)
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"]["parameters"]
        return None


def _schema() -> dict[str, Any]:
    text = resources.files("k3load").joinpath("schemas/scenario.schema.json").read_text()
    return json.loads(text)


def _where(error: jsonschema.ValidationError) -> str:
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return path.lstrip(".") or "(top level)"


def _check_shape(data: Any, path: Path) -> None:
    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ScenarioError(f"{path}: {_where(first)}: {first.message}{more}")


def _check_references(data: dict[str, Any], path: Path) -> None:
    if data.get("mode") == logged.LOGGED:
        _check_logged(data, path)
        return
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in data.get("tools", [])}
    for i, tool in enumerate(data.get("tools", [])):
        try:
            jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
        except jsonschema.SchemaError as exc:
            raise ScenarioError(f"{path}: tools[{i}].function.parameters: not a valid JSON Schema: "
                                f"{exc.message}") from exc
    for name in data.get("executors", {}):
        if name not in tools:
            raise ScenarioError(f"{path}: executors.{name}: no tool of that name")
    for i, turn in enumerate(data["turns"]):
        where = f"{path}: turns[{i}]"
        for key in ("tools", "calls"):
            for name in turn["expect"].get(key, []):
                if name not in tools:
                    raise ScenarioError(f"{where}.expect.{key}: unknown tool {name!r}")
        for j, call in enumerate((turn.get("reply") or {}).get("tool_calls", [])):
            if call["name"] not in tools:
                raise ScenarioError(f"{where}.reply.tool_calls[{j}].name: unknown tool {call['name']!r}")
            if call["name"] not in data.get("executors", {}):
                raise ScenarioError(f"{where}.reply.tool_calls[{j}]: tool {call['name']!r} has no executor")
            try:
                jsonschema.validate(call["arguments"], tools[call["name"]])
            except jsonschema.ValidationError as exc:
                raise ScenarioError(f"{where}.reply.tool_calls[{j}].arguments: {exc.message}") from exc
        _check_turn_order(data, i, turn, where)


def _check_logged(data: dict[str, Any], path: Path) -> None:
    """A logged scenario: every turn has its body and messages; its tools' schemas are valid once
    normalised; executors and expectations name tools the turn (or some turn) offered."""
    offered: set[str] = set()
    checked: set[str] = set()  # parameter schemas already checked: a conversation resends its tools every turn
    for i, turn in enumerate(data["turns"]):
        where = f"{path}: turns[{i}]"
        for key in ("request", "messages"):
            if key not in turn:
                raise ScenarioError(f"{where}.{key}: required in a logged scenario")
        for key in ("user", "reply", "fallback", *TURN_SETTINGS):
            if key in turn:
                raise ScenarioError(f"{where}.{key}: a logged turn takes its settings from its `request`")
        tools = turn["request"].get("tools", [])
        if not isinstance(tools, list):
            raise ScenarioError(f"{where}.request.tools: not a list")
        names = set()
        for j, tool in enumerate(tools):
            name = logged.tool_name(tool)
            if name is None:
                raise ScenarioError(f"{where}.request.tools[{j}]: no function name")
            parameters = logged.tool_parameters(tool)
            key = json.dumps(parameters, sort_keys=True, default=str)
            if key not in checked:
                try:
                    jsonschema.Draft202012Validator.check_schema(parameters)
                except jsonschema.SchemaError as exc:
                    raise ScenarioError(f"{where}.request.tools[{j}].function.parameters: not a valid JSON Schema, "
                                        f"even normalised: {exc.message}") from exc
                checked.add(key)
            names.add(name)
        for key in ("tools", "calls"):
            for name in turn["expect"].get(key, []):
                if name not in names:
                    raise ScenarioError(f"{where}.expect.{key}: unknown tool {name!r} (not in the turn's request)")
        if turn["expect"]["kind"] == "json" and "schema" not in turn["expect"] and \
                "response_format" not in turn["request"]:
            raise ScenarioError(f"{where}.expect.schema: a json turn needs a schema or a response_format")
        offered |= names
    for name in data.get("executors", {}):
        if name not in offered:
            raise ScenarioError(f"{path}: executors.{name}: no turn offers a tool of that name")
    if data.get("prefix_salt", "none") != "none":
        raise ScenarioError(f"{path}: prefix_salt: a logged scenario is sent as logged (none)")


def _check_turn_order(data: dict[str, Any], i: int, turn: dict[str, Any], where: str) -> None:
    if turn["expect"]["kind"] == "json" and "schema" not in turn["expect"] and "response_format" not in turn:
        raise ScenarioError(f"{where}.expect.schema: a json turn needs a schema or a response_format")
    calls, allowed = turn["expect"].get("calls"), turn["expect"].get("tools")
    if calls and turn["expect"]["kind"] != "tool_call":
        raise ScenarioError(f"{where}.expect.calls: only a tool_call turn expects calls")
    if calls and allowed and set(calls) - set(allowed):
        raise ScenarioError(f"{where}.expect.calls: {sorted(set(calls) - set(allowed))} not in expect.tools")
    if turn["expect"]["kind"] == "tool_call" and not data.get("tools"):
        raise ScenarioError(f"{where}.expect.kind: tool_call but the scenario has no tools")
    conversation = data.get("mode", "conversation") == "conversation"
    if conversation and i < len(data["turns"]) - 1 and "reply" not in turn:
        raise ScenarioError(f"{where}.reply: required in a conversation (except on the last turn): it is what "
                            "the history holds for the next turn")
    if "user" in turn:
        return
    previous = data["turns"][i - 1] if i else None
    if data.get("mode", "conversation") != "conversation" or not previous or \
            not (previous.get("reply") or {}).get("tool_calls"):
        raise ScenarioError(f"{where}.user: required unless the previous turn's reply has tool_calls")


def _merge(defaults: dict[str, Any], turn: dict[str, Any]) -> dict[str, Any]:
    settings = {**DEFAULT_SETTINGS, **defaults}
    settings["retry"] = {**DEFAULT_RETRY, **defaults.get("retry", {})}
    for key in TURN_SETTINGS:
        if key in turn:
            settings[key] = {**settings["retry"], **turn[key]} if key == "retry" else turn[key]
    return settings


def parse_scenario(data: Any, path: Path) -> Scenario:
    """A scenario from already-loaded YAML data (validated)."""
    _check_shape(data, path)
    _check_references(data, path)
    defaults = data.get("defaults", {})
    if data.get("mode") == logged.LOGGED:
        merged = _merge(defaults, {})
        schemas: dict[int, dict[str, Any]] = {}  # turns that share one tool list (a YAML alias) share its schemas
        turns = tuple(Turn(index=i, expect=t["expect"], settings=logged.settings_of(t["request"], merged),
                           messages=tuple(t["messages"]), request=t["request"], recorded=t.get("recorded"),
                           tool_schemas=schemas.get(id(logged.request_tools(t["request"])))
                           or schemas.setdefault(id(logged.request_tools(t["request"])),
                                                 logged.offered_schemas(t["request"])))
                      for i, t in enumerate(data["turns"]))
    else:
        turns = tuple(_scripted_turn(data, i, t, _merge(defaults, t), path) for i, t in enumerate(data["turns"]))
    return Scenario(name=data["name"], family=data["family"], system_prompt=data.get("system_prompt", ""),
                    turns=turns,
                    path=path, description=data.get("description", ""), mode=data.get("mode", "conversation"),
                    prefix_salt=data.get("prefix_salt", "none"), context=tuple(data.get("context", [])),
                    tools=tuple(data.get("tools", [])), executors=data.get("executors", {}),
                    long_input=data.get("long_input"), user_think_s=data.get("user_think_s"),
                    history=data.get("history"), source=data.get("source"))


def _scripted_turn(data: dict[str, Any], i: int, turn: dict[str, Any], settings: dict[str, Any], path: Path) -> Turn:
    where = f"{path}: turns[{i}]"
    retry = settings["retry"]
    if "first_timeout_attempts" in retry and not retry.get("first_timeout_s"):
        raise ScenarioError(f"{where}.retry.first_timeout_attempts: needs first_timeout_s (the short deadline)")
    if retry.get("first_timeout_attempts", 1) > retry["max_attempts"]:
        raise ScenarioError(f"{where}.retry.first_timeout_attempts: {retry['first_timeout_attempts']} is more than "
                            f"max_attempts {retry['max_attempts']}")
    if retry.get("first_timeout_attempts", 0) == retry["max_attempts"] and "fallback" not in turn:
        raise ScenarioError(f"{where}.retry.first_timeout_attempts: every one of the {retry['max_attempts']} "
                            "attempts gets the short deadline, so the turn can only be answered by a fallback: "
                            "declare `fallback:` or lower first_timeout_attempts")
    fallback = _fallback(data, turn, settings, where) if "fallback" in turn else None
    return Turn(index=i, expect=turn["expect"], user=turn.get("user"), reply=turn.get("reply"), settings=settings,
                fallback=fallback)


def _fallback(data: dict[str, Any], turn: dict[str, Any], settings: dict[str, Any], where: str) -> Fallback:
    """The turn's `fallback:` (its shape already checked by the schema), checked against the turn: a choice
    needs tools to choose among, a forced call a turn that expects one, a dropped response_format one to drop,
    and a fallback must change something."""
    fallback, where = Fallback.of(turn["fallback"]), f"{where}.fallback"
    tools = [t["function"]["name"] for t in data.get("tools", [])]
    choice = fallback.tool_choice
    if choice is not None and not tools:
        raise ScenarioError(f"{where}.tool_choice: the scenario has no tools to choose among")
    if choice not in (None, "none", "auto") and turn["expect"]["kind"] != "tool_call":
        raise ScenarioError(f"{where}.tool_choice: {choice!r} forces a call, but the turn expects "
                            f"{turn['expect']['kind']!r}")
    if isinstance(choice, dict) and choice["function"]["name"] not in tools:
        raise ScenarioError(f"{where}.tool_choice.function.name: unknown tool {choice['function']['name']!r}")
    if fallback.drop_response_format and "response_format" not in settings:
        raise ScenarioError(f"{where}.response_format: the turn sends no response_format to drop")
    unchanged = (fallback.max_tokens in (None, settings["max_tokens"])
                 and choice in (None, settings.get("tool_choice", "auto")) and not fallback.drop_response_format
                 and fallback.model is None)
    if unchanged:
        raise ScenarioError(f"{where}: changes nothing the turn sends (its max_tokens {settings['max_tokens']}, "
                            f"tool_choice {settings.get('tool_choice', 'auto')!r})")
    return fallback


TOOL_TURN_CHOICES = ("auto", "required", "named")


def with_tool_turns(scenario: Scenario, choice: str) -> Scenario:
    """The scenario with its tool-call turns sent as `choice` says (a plan's `tool_turns`).

    Why a plan setting and not copies of the scenarios: a small real model cannot be expected to pick
    tools on its own (`auto`), but it can fill a call vLLM constrains to the tool's schema (`required`,
    or the tool named). The prompts, tools, histories and expectations stay the production ones; only
    the tool_choice of turns that expect a call and do not set one themselves changes, and the body
    (so the stored sample and its hash) says so. `named` names the expected tool when the turn allows
    exactly one and expects a single call (a named choice yields one call; parallel calls need
    `required`), else falls back to `required`. Answer and JSON turns keep their own choice.
    """
    if choice == "auto" or scenario.is_logged:  # a logged body is sent as logged
        return scenario
    turns = tuple(
        replace(t, settings={**t.settings, "tool_choice": _tool_choice(t, choice)})
        if t.kind == "tool_call" and "tool_choice" not in t.settings else t
        for t in scenario.turns)
    return replace(scenario, turns=turns)


def _tool_choice(turn: Turn, choice: str) -> str | dict[str, Any]:
    tools = turn.expect.get("tools") or []
    if choice == "named" and len(tools) == 1 and len(turn.expect.get("calls") or []) <= 1:
        return {"type": "function", "function": {"name": tools[0]}}
    return "required"


def load_scenario(path: Path) -> Scenario:
    """One file; every failure (unreadable, YAML syntax, schema, references) is one line naming it."""
    try:
        _text, data = read_yaml_file(path, "scenario")
    except YamlFileError as exc:
        raise ScenarioError(str(exc)) from None
    return parse_scenario(data, path)


def load_scenarios(paths: list[Path]) -> list[Scenario]:
    """Every file, in name order; duplicate scenario names are an error."""
    scenarios = [load_scenario(p) for p in sorted(paths)]
    seen: dict[str, Path] = {}
    for s in scenarios:
        if s.name in seen:
            raise ScenarioError(f"{s.path}: name {s.name!r} is already used by {seen[s.name]}")
        seen[s.name] = s.path
    if not scenarios:
        raise ScenarioError("no scenario files given")  # callers name their option (--k3-scenarios)
    return scenarios


def execute_tool(scenario: Scenario, name: str, arguments: dict[str, Any] | None) -> str:
    """The deterministic tool result (as the tool message's content)."""
    executor = scenario.executors[name]
    if not isinstance(arguments, dict):  # a model's call whose arguments are not an object: no row matches
        return _as_text(executor["default"])
    for row in executor.get("table", []):
        if row["match"].items() <= arguments.items():
            return _as_text(row["result"])
    return _as_text(executor["default"])


def _as_text(result: Any) -> str:
    return result if isinstance(result, str) else json.dumps(result, separators=(",", ":"))
