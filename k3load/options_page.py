"""docs/options.md, written from the argparse definitions themselves.

Why generated: an options list written by hand drifts (a renamed flag, a changed default) and a user
copies the stale one into CI. The page is rendered from the same parsers the commands build, and
`tests/unit/test_options_page.py` fails when the committed page differs from what they render now.

    .venv/bin/python -m k3load.options_page > docs/options.md
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

HEADER = """# Options

Generated from the argparse definitions by `k3load/options_page.py` (`.venv/bin/python -m k3load.options_page >
docs/options.md`); `tests/unit/test_options_page.py` fails when this page and the code disagree. What the options do
in a run is told in [running.md](running.md); this page is the list.
"""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction,
                           argparse._VersionAction)):
        return ""
    if action.default in (None, argparse.SUPPRESS, "", []):
        return ""
    return f"`{action.default}`"


def _name(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.nargs != 0:
            names += f" {action.metavar or 'VALUE'}" if not action.choices else ""
        return names
    return f"`{action.metavar or action.dest}`"


def _rows(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        text = _cell(action.help or "")
        if action.choices and not isinstance(action.choices, dict):
            text += f" (one of: {', '.join(f'`{c}`' for c in action.choices)})"
        env = getattr(action, "env_var", None)
        flags = []
        if env:
            flags.append(f"env `{env}`")
        if getattr(action, "is_secret", False):
            flags.append("secret: never written")
        if getattr(action, "include_in_web_ui", True) is False:
            flags.append("not in the web UI")
        if getattr(action, "required", False):
            flags.append("required")
        yield f"| {_name(action)} | {_default(action)} | {'; '.join(flags)} | {text} |"


def _table(parser: argparse.ArgumentParser) -> list[str]:
    rows = list(_rows(parser))
    if not rows:
        return ["No options.", ""]
    return ["| option | default | notes | what it does |", "|---|---|---|---|", *rows, ""]


def _first_paragraph(text: str | None) -> str:
    return _cell((text or "").strip().split("\n\n")[0])


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def locust_parser() -> Any:
    """The `--k3-*` options as Locust sees them (its parser keeps env_var, is_secret, include_in_web_ui)."""
    from locust.argument_parser import LocustArgumentParser

    from k3load.loadgen.options import add_options

    parser = LocustArgumentParser(add_help=False)
    add_options(parser)
    return parser


def render() -> str:
    from k3load.cli import build_parser
    from k3load.targets.vllm_cpu import build_parser as vllm_cpu_parser

    out = [HEADER, "## `locust -f locustfiles/agent.py`", "",
           "The harness's own options, beside Locust's (`--host`, `--users`, `--headless`, ...: see "
           "`locust --help`). Each can also be set from its environment variable.", "",
           *_table(locust_parser())]
    k3load = build_parser()
    out += ["## `k3load`", "", _first_paragraph(k3load.description), "", *_table(k3load)]
    for name, sub in _subcommands(k3load):
        out += [f"### `k3load {name}`", "", _first_paragraph(sub.description), "", *_table(sub)]
    target = vllm_cpu_parser()
    out += ["## `python -m k3load.targets.vllm_cpu`", "", _first_paragraph(target.description), "", *_table(target)]
    for name, sub in _subcommands(target):
        out += [f"### `python -m k3load.targets.vllm_cpu {name}`", "", _first_paragraph(sub.description), "",
                *_table(sub)]
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
