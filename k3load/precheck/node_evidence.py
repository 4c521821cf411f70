"""Each node's startup log and collect-env under DIR/evidence, gathered and loaded back per node.

Layout (relative to DIR/evidence/). The single-node form (a bare path) keeps the paths older runs have:
  startup.log                       the unnamed node's startup log
  container/collect-env.txt         the unnamed node's collect-env
and each named node (NODE=PATH, k3load.precheck.node_files) has its own:
  startup/NODE.log
  container/NODE/collect-env.txt
NODE is restricted to a node name's characters (node_files.NODE_NAME), so the file name is the node's
name and a recheck reads the node back from it.

Why a module of its own: the rules read every node's facts through `NodeFacts` lists (`containers`,
`startups`), whichever form was given, so one node's evidence never stands for another's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3load.precheck.evidence_store import Evidence, Gatherer
from k3load.precheck.formats import check_collect_env
from k3load.precheck.node_files import NODE_NAME, NodeFiles
from k3load.precheck.startup_log import parse_startup_log

CONTAINER_BARE = "container/collect-env.txt"
STARTUP_BARE = "startup.log"


@dataclass(frozen=True)
class NodeFacts:
    """One node's parsed file: `node` None for the single-node form; `file` relative to DIR/evidence."""

    node: str | None
    facts: dict[str, Any]
    file: str

    @property
    def where(self) -> str:
        """How a reason names it: "node n01", or "unnamed node" for the single-node form."""
        return f"node {self.node}" if self.node else "unnamed node"


def container_rel(node: str | None) -> str:
    return CONTAINER_BARE if node is None else f"container/{node}/collect-env.txt"


def startup_rel(node: str | None) -> str:
    return STARTUP_BARE if node is None else f"startup/{node}.log"


def gather_containers(g: Gatherer, container_info: NodeFiles) -> None:
    """Copy each node's collect-env to its own path (redacted, as every copy)."""
    for entry in container_info.entries:
        g.copy(entry.path, container_rel(entry.node))


def gather_startups(g: Gatherer, startup_log: NodeFiles) -> None:
    """Copy each node's startup log to its own path (redacted: a startup log prints its own --api-key)."""
    for entry in startup_log.entries:
        g.copy(entry.path, startup_rel(entry.node))


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def load_node_files(root: Path, ev: Evidence, platform: str) -> None:
    """Every node's collect-env and startup log under DIR/evidence into `ev` (bare and named forms)."""
    collect = root / CONTAINER_BARE
    if collect.exists():
        ev.container = check_collect_env(_read(collect), collect)
        ev.files["container"] = CONTAINER_BARE
    for path in sorted((root / "container").glob("*/collect-env.txt")):
        node = path.parent.name
        if NODE_NAME.match(node):
            ev.node_containers[node] = check_collect_env(_read(path), path)
            ev.files[f"container:{node}"] = container_rel(node)
    log = root / STARTUP_BARE
    if log.exists():
        ev.startup = parse_startup_log(_read(log), platform)
        ev.files["startup"] = STARTUP_BARE
    for path in sorted((root / "startup").glob("*.log")):
        if NODE_NAME.match(path.stem):
            ev.node_startups[path.stem] = parse_startup_log(_read(path), platform)
            ev.files[f"startup:{path.stem}"] = startup_rel(path.stem)


def containers(ev: Evidence) -> list[NodeFacts]:
    """Every collect-env: the unnamed node's first, then the named nodes' by name."""
    bare = [NodeFacts(None, ev.container, CONTAINER_BARE)] if ev.container is not None else []
    return bare + [NodeFacts(n, f, container_rel(n)) for n, f in sorted(ev.node_containers.items())]


def startups(ev: Evidence) -> list[NodeFacts]:
    """Every startup log: the unnamed node's first, then the named nodes' by name."""
    bare = [NodeFacts(None, ev.startup, STARTUP_BARE)] if ev.startup is not None else []
    return bare + [NodeFacts(n, f, startup_rel(n)) for n, f in sorted(ev.node_startups.items())]


def missing_nodes(ev: Evidence, given: list[NodeFacts]) -> list[str]:
    """The inventoried nodes without a file of this kind while other nodes have theirs by name: named,
    never passed over. With the single-node form (one unnamed file) or none at all, nothing is missing
    here (the rules say "no file" or judge the one given)."""
    named = {f.node for f in given if f.node}
    if not named:
        return []
    return [h["node"] for h in ev.hosts if h["node"] not in named]


def stray_nodes(ev: Evidence, given: list[NodeFacts]) -> list[str]:
    """Named nodes of this kind that no host inventory names (when the inventories name any)."""
    hosts = {h["node"] for h in ev.hosts}
    return [f.node for f in given if f.node and hosts and f.node not in hosts]
