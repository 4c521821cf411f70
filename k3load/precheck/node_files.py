"""Per-node evidence files: `--startup-log` / `--container-info` (Locust: `--k3-...`) as NODE=PATH entries.

    parse_node_files(["n01=/ev/n01.log", "n02=/ev/n02.log"], "--k3-startup-log")
    # NodeFiles(flag="--k3-startup-log", entries=(NodeFile("n01", Path("/ev/n01.log")), NodeFile("n02", ...)))
    parse_node_files("vllm.log", "--startup-log")      # the single-node form: one unnamed node (node None)

Why: a multi-node K3 has one startup log and one collect-env per node, and one node's evidence must
not stand for all; each node's is gathered apart and judged per node (k3load.precheck.rules).

The text, from the command line, an env var (K3_STARTUP_LOG, K3_CONTAINER_INFO) or a config file:
each value holds one entry or several, separated by newlines or commas (a comma splits only where
every piece is NODE=PATH, so a bare path may hold one). An entry is NODE=PATH, where NODE is a node
name as the host inventories spell it (letters, digits, `.`, `_`, `-`; it is the evidence's file name
too), or a bare PATH, the single-node form (a PATH with `=` before its first `/` is given as ./PATH).
Blank entries are skipped. A malformed text (an empty node, a node twice, an empty path, a bare path
beside named ones) raises NodeFilesError naming the option: a harness error, before anything is read.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3load.errors import InputError

NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SPLIT_LINES = re.compile(r"[\r\n]+")


class NodeFilesError(InputError):
    """A NODE=PATH text that cannot be read: one line, naming the option."""


@dataclass(frozen=True)
class NodeFile:
    """One node's file; `node` None is the single-node form (a bare path: one unnamed node)."""

    node: str | None
    path: Path


@dataclass(frozen=True)
class NodeFiles:
    """The entries of one option, in the order given; empty when the option was not given."""

    flag: str
    entries: tuple[NodeFile, ...] = ()

    @property
    def named(self) -> bool:
        """True when the entries name their nodes (the per-node form)."""
        return any(e.node is not None for e in self.entries)

    def nodes(self) -> list[str]:
        return [e.node for e in self.entries if e.node is not None]

    def paths(self) -> list[Path]:
        return [e.path for e in self.entries]

    def __bool__(self) -> bool:
        return bool(self.entries)


def _pieces(value: str) -> list[str]:
    """A value's entries: one a line, and a line cut at commas only where every piece is NODE=PATH."""
    out = []
    for line in _SPLIT_LINES.split(value):
        parts = [p.strip() for p in line.split(",")]
        named = [p for p in parts if p]
        if len(parts) > 1 and named and all(_node_part(p) is not None for p in named):
            out += named
        elif line.strip():
            out.append(line.strip())
    return out


def _node_part(entry: str) -> str | None:
    """The NODE of NODE=PATH ("" for "=PATH"), or None when the entry is a bare path."""
    head, sep, _ = entry.partition("=")
    if not sep or "/" in head or "\\" in head:
        return None
    return head.strip()


def _entry(entry: str, flag: str) -> NodeFile:
    node = _node_part(entry)
    if node is None:
        return NodeFile(None, Path(entry))
    path = entry.partition("=")[2].strip()
    if not node:
        raise NodeFilesError(f"{flag} {entry!r}: empty node name (NODE=PATH)")
    if not NODE_NAME.match(node):
        raise NodeFilesError(f"{flag} {entry!r}: node name {node!r} is not a node name (letters, digits, '.', '_', "
                             "'-', as the host inventories name nodes)")
    if not path:
        raise NodeFilesError(f"{flag} {entry!r}: path missing for node {node} (NODE=PATH)")
    return NodeFile(node, Path(path))


def parse_node_files(values: str | Path | Sequence[str | Path] | None, flag: str) -> NodeFiles:
    """The option's entries; NodeFilesError on an empty node, a node given twice, an empty path, or a
    bare path beside another entry (every node must then be named)."""
    if values is None:
        values = []
    elif isinstance(values, str | Path):
        values = [values]
    entries = [_entry(piece, flag) for value in values for piece in _pieces(str(value))]
    seen: set[str | None] = set()
    for e in entries:
        if e.node in seen:
            what = f"node {e.node}" if e.node else "more than one bare path (the single-node form)"
            raise NodeFilesError(f"{flag}: {what} given twice: one file per node")
        seen.add(e.node)
    if None in seen and len(entries) > 1:
        raise NodeFilesError(f"{flag}: a bare path beside NODE=PATH entries: name every node (NODE=PATH), or "
                             "give one bare path for a single node")
    return NodeFiles(flag, tuple(entries))


def as_node_files(value: NodeFiles | str | Path | Sequence[str | Path] | None, flag: str) -> NodeFiles:
    """What run_precheck accepts for one of these options: NodeFiles as they are, else the option's text."""
    return value if isinstance(value, NodeFiles) else parse_node_files(value, flag)


def unknown_nodes(files: NodeFiles, inventory_nodes: Iterable[str]) -> str | None:
    """A problem line when the entries name nodes the host inventories do not (only where the inventories
    name nodes at all: without inventories there is nothing to match)."""
    known = set(inventory_nodes)
    if not known or not files.named:
        return None
    unknown = [n for n in files.nodes() if n not in known]
    if not unknown:
        return None
    return (f"{files.flag}: node {', '.join(unknown)} is in no host inventory (the inventories name "
            f"{', '.join(sorted(known))}): NODE must be the node name of its inventory")


class NodeFilesAction(argparse._AppendAction):
    """argparse action for the per-node options: repeatable (and a list in a config file, as an append
    option), each value kept as given, joined one a line into one text (the option's value stays a str,
    as it was for a single path); parse_node_files reads it. Checked in k3load.loadgen.inputs."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        before = getattr(namespace, self.dest, None) or ""
        text = str(values)
        setattr(namespace, self.dest, f"{before}\n{text}" if before and text else (before or text))
