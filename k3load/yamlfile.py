"""Read one YAML input file (scenario, plan, recipe) into data, or fail with one line that says where.

    data = load_yaml_text(text, path)   # YamlFileError("scenarios/x.yaml:12:5: YAML error: mapping values ...")

Why: PyYAML's own message spans several lines (the problem, the context, a quoted source line and a
caret) and says `<unicode string>` instead of the file. A harness error must be one line that an
operator can paste into an editor's "go to" (`FILE:LINE:COLUMN`), so the marks are turned into that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from k3load.errors import InputError


class YamlFileError(InputError):
    """A file that is not valid YAML: the message is `FILE:LINE:COLUMN: YAML error: PROBLEM`."""


def one_line(text: str) -> str:
    """Any message as one line (a harness error is printed as exactly one line)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def describe_yaml_error(exc: yaml.YAMLError, path: Path | str) -> str:
    """`FILE:LINE:COLUMN: YAML error: PROBLEM (CONTEXT at LINE:COLUMN)`, 1-based like an editor."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return f"{path}: YAML error: {one_line(str(exc))}"
    mark = exc.problem_mark
    problem = one_line(exc.problem or "")
    if exc.context:
        where = exc.context_mark
        started = f" started at {where.line + 1}:{where.column + 1}" if where is not None else ""
        problem += f" ({one_line(exc.context)}{started})"
    return f"{path}:{mark.line + 1}:{mark.column + 1}: YAML error: {problem}"


def decode_text(raw: bytes, path: Path | str, what: str) -> str:
    """UTF-8 text of a file's bytes; anything else is one line naming the file and the byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise YamlFileError(f"{path}: cannot read {what}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_yaml_file(path: Path, what: str) -> tuple[str, Any]:
    """(text, data) of a YAML file; unreadable, not UTF-8 or not YAML is one line naming the file."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise YamlFileError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    text = decode_text(raw, path, what)
    return text, load_yaml_text(text, path)


_FAST_LOADER = getattr(yaml, "CSafeLoader", None)  # libyaml's, where PyYAML was built with it (its wheels are)


def load_yaml_text(text: str, path: Path | str) -> Any:
    """Parse `text` (read from `path`) with the safe loader; a syntax error names file, line and column.

    Why libyaml first: an import of an agent's log writes megabytes of scenarios (k3load import), read at every
    run's start; on 40 of the 400 files a 45 MB log became, the pure parser took 2.07 s and libyaml 0.13 s
    (this 2-core machine, a test run beside it), into the same values (the same safe constructor builds them).
    Where libyaml refuses a text, the pure parser reads it again, so what an operator sees about a bad file is
    its one wording, whichever parser is installed."""
    if _FAST_LOADER is not None:
        try:
            return yaml.load(text, Loader=_FAST_LOADER)  # CSafeLoader: the safe constructor
        except yaml.YAMLError:
            pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise YamlFileError(describe_yaml_error(exc, path)) from None
