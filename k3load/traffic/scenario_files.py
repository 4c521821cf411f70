"""Rebuilt conversations -> logged scenario files (`mode: logged`), written all at once or not at all.

Why YAML with the bodies' keys in logged order: the files are scenarios like any other
(`--k3-scenarios 'DIR/*.yaml'`), read by the same strict loader, and a reader can see and edit them.
PyYAML keeps mapping order both ways (`sort_keys=False`, and a loaded mapping is a dict), and every
string comes back as the same string (quoted or escaped where plain YAML would misread it); the tests
hold the round trip to that for arbitrary JSON. A tool list repeated turn after turn is written once and
referred to by a YAML alias (the same object in each turn), so a 40-turn conversation with a 30 KB tool
head is not 1.2 MB.

Why all at once: an import either writes every scenario and its summary (`import.json`) or nothing. The
files are written into a fresh folder beside DIR and that folder is renamed to DIR, so a failure (a
full disk, an interrupt) leaves no half-written scenario set that a glob would pick up. DIR must not
exist or be empty. Files are 0600 and folders 0700 (the operator's traffic, even redacted).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from k3load.errors import InputError
from k3load.private_files import open_private
from k3load.traffic import expectations
from k3load.traffic.threads import Conversation
from k3load.workload import logged

TIMEOUT_S = 180.0  # an agent's request may generate for minutes on a loaded server: 60 s would fail it falsely


class OutDirError(InputError):
    """DIR cannot take the import: the message names it."""


def scenario_of(conversation: Conversation, name: str, family: str, log_names: str) -> dict[str, Any]:
    """One conversation as a logged scenario (a plain dict, keys in the order the file shows them)."""
    shared: dict[bytes, Any] = {}
    turns: list[dict[str, Any]] = []
    recorded_answers: list[dict[str, Any] | None] = []
    unanswered: list[int] = []
    for i, (exchange, added) in enumerate(zip(conversation.turns, conversation.added, strict=True)):
        request = {k: (None if k == "messages" else _shared(v, shared) if k == "tools" else v)
                   for k, v in exchange.body.items()}
        request.setdefault("messages", None)
        answer = exchange.answer
        if answer is None and i + 1 < len(conversation.added):
            following = conversation.added[i + 1]
            answer = following[0] if following and following[0].get("role") == "assistant" else None
        recorded = expectations.recorded_answer(answer)
        recorded_answers.append(recorded)
        if recorded is None:
            unanswered.append(i)
        turn: dict[str, Any] = {"messages": added, "request": request,
                                "expect": expectations.expectation(recorded, exchange.body)}
        if recorded is not None:
            turn["recorded"] = recorded
        turns.append(turn)
    offered = {logged.tool_name(t) for e in conversation.turns for t in logged.request_tools(e.body)}
    executors = expectations.executors(conversation.added, recorded_answers, {n for n in offered if n})
    models = {e.body.get("model") for e in conversation.turns}
    source: dict[str, Any] = {"log": log_names, "lines": [e.where for e in conversation.turns],
                              "logged_model": next(iter(models)) if len(models) == 1 else None,
                              "turns_without_answer": unanswered, "duplicates": conversation.duplicates}
    said = f"; turn index {', '.join(map(str, unanswered))} (from 0) without a recorded answer: judged on validity " \
        "alone" if unanswered else ""
    data: dict[str, Any] = {
        "name": name, "family": family, "mode": logged.LOGGED,
        "description": f"Imported by `k3load import` from {log_names} ({len(turns)} turns, first at "
                       f"{conversation.turns[0].where}){said}.",
        "source": source, "defaults": {"timeout_s": TIMEOUT_S}}
    if executors:
        data["executors"] = executors
    data["turns"] = turns
    return data


def _shared(value: Any, shared: dict[bytes, Any]) -> Any:
    """The first object equal to `value` (as JSON, key order included) seen in this scenario: written once."""
    key = json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return shared.setdefault(key, value)


class _Dumper(yaml.SafeDumper):
    """Safe YAML that writes aliases for repeated objects (the shared tool lists) and never folds a
    string: a folded line is read back the same, but an operator diffing two imports reads it better whole."""


_YAML_BREAKS = ("\x85", "\u2028", "\u2029", "\ufeff")


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    """A string holding a character YAML 1.1 reads as a line break (NEL, LS, PS) or drops (a BOM) is
    written double-quoted, where PyYAML escapes it: plain or block style would fold it into a space
    (found by the round-trip property test)."""
    style = '"' if any(c in value for c in _YAML_BREAKS) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


def to_yaml(data: dict[str, Any]) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1 << 30,
                     default_flow_style=False)


def check_out_dir(out: Path) -> None:
    """DIR must be absent or an empty folder: an import never mixes with earlier files."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OutDirError(f"--out {out}: exists and is not an empty folder (an import writes a fresh one)")


def write_all(out: Path, files: dict[str, str]) -> None:
    """Every file (name -> text) into DIR at once (see the module docstring)."""
    check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.import-", dir=out.parent))
    try:
        os.chmod(staging, 0o700)
        for name, text in files.items():
            with open_private(staging / name, "w", encoding="utf-8") as handle:
                handle.write(text)
        if out.exists():
            out.rmdir()  # empty (checked): the rename needs it gone
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
