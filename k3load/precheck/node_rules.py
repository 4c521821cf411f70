"""The rule that every node is the same: driver, container tag and, per node, the vLLM and CUDA build.

Why apart from rules.py: with per-node evidence (NODE=PATH, k3load.precheck.node_files) "the same on
every node" compares each node's own collect-env and startup log too, and names the node that differs
("0.27.0 on n02") or that gave nothing while the others did ("node n03: no startup log given"), never
passing over it. What is compared is data (COMPARED): the fact, where it is read, and how it is named.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from k3load.outcomes import FAIL, INCONCLUSIVE, PASS
from k3load.precheck.evidence import Evidence
from k3load.precheck.node_evidence import NodeFacts, containers, missing_nodes, startups, stray_nodes
from k3load.precheck.recipe import Recipe
from k3load.precheck.rule_base import files_of, host_files, na_result, no_hosts_why, option, result

# (what a reason calls it, the node files it is read from, the fact in one node's facts)
COMPARED: tuple[tuple[str, Callable[[Evidence], list[NodeFacts]], Callable[[dict[str, Any]], Any]], ...] = (
    ("vLLM version (collect-env)", containers, lambda f: f.get("vllm_version")),
    ("vLLM git sha (collect-env)", containers, lambda f: f.get("vllm_git_sha")),
    ("CUDA build (collect-env)", containers, lambda f: f.get("cuda_build")),
    ("PyTorch (collect-env)", containers, lambda f: f.get("torch_version")),
    ("vLLM version (startup log)", startups, lambda f: (f.get("vllm_version") or {}).get("value")),
)


def normalise_image(image: str) -> str:
    """repository:tag without registry default, library/ prefix or @sha256 digest (compared by tag)."""
    name = image.strip().split("@", 1)[0]
    for prefix in ("docker.io/", "index.docker.io/", "registry-1.docker.io/"):
        name = name.removeprefix(prefix)
    return name.removeprefix("library/")


def images_seen(ev: Evidence) -> dict[str, str]:
    seen = {"--image": ev.image} if ev.image else {}
    seen.update({f"node {h['node']}": h["container_image"] for h in ev.hosts if h.get("container_image")})
    return seen


def container_value(ev: Evidence, key: str) -> Any:
    """The first collect-env (unnamed, then by node) that records `key`; None when none does."""
    return next((c.facts[key] for c in containers(ev) if c.facts.get(key)), None)


def not_given(nodes: list[str], what: str, name: str) -> str:
    """"node n03: no startup log given" for each node, and the option that gives it."""
    return "; ".join(f"node {n}: no {what} given" for n in nodes) + f" ({option(name)} NODE=PATH)"


def build_differences(ev: Evidence) -> list[str]:
    """Each compared fact that differs between named nodes, the nodes grouped by value."""
    problems = []
    for label, files, fact in COMPARED:
        by_value: dict[str, list[str]] = {}
        for given in files(ev):
            value = fact(given.facts)
            if given.node and value:
                by_value.setdefault(str(value), []).append(given.node)
        if len(by_value) > 1:
            listed = "; ".join(f"{value} on {', '.join(nodes)}" for value, nodes in
                               sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[0])))
            problems.append(f"nodes differ in {label}: {listed}")
    return problems


def evidence_gaps(ev: Evidence) -> list[str]:
    """Inventoried nodes without their collect-env / startup log while others have theirs, and node files
    named for a node that no inventory names."""
    gaps = []
    for what, name, given in (("collect-env", "container-info", containers(ev)),
                              ("startup log", "startup-log", startups(ev))):
        if missing := missing_nodes(ev, given):
            gaps.append(not_given(missing, what, name))
        gaps += [f"node {n}: {what} given, but no host inventory names the node" for n in stray_nodes(ev, given)]
    return gaps


def node_table(ev: Evidence) -> dict[str, dict[str, Any]]:
    """Per node (inventoried or named in the evidence): what was recorded of it, for the checklist."""
    table: dict[str, dict[str, Any]] = {h["node"]: {"driver": h["driver_version"], "image": h.get("container_image"),
                                                    "collect_env": None, "startup_log": None} for h in ev.hosts}
    for key, given in (("collect_env", containers(ev)), ("startup_log", startups(ev))):
        for g in given:
            if g.node:
                table.setdefault(g.node, {"driver": None, "image": None, "collect_env": None,
                                          "startup_log": None})[key] = g.file
    return dict(sorted(table.items()))


def node_consistency(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """All nodes run the same driver and container tag (and --image agrees with them), and, given per node,
    the same vLLM and CUDA build; a node without its evidence while the others have theirs is named."""
    if skip := na_result(recipe, "node_consistency", "driver"):
        return skip
    named = [g.file for g in containers(ev) + startups(ev) if g.node]
    files = host_files(ev) + files_of(ev, "image") + named
    details = {"nodes": node_table(ev)}
    builds = build_differences(ev)
    if not ev.hosts and not builds:
        return result("node_consistency", INCONCLUSIVE, f"no nodes to compare: {no_hosts_why(ev)}", files, **details)
    problems = _host_differences(ev) + builds
    if problems:
        return result("node_consistency", FAIL, "; ".join(problems), files, **details)
    if not ev.hosts:
        return result("node_consistency", INCONCLUSIVE, f"no nodes to compare: {no_hosts_why(ev)}", files, **details)
    drivers = {h["driver_version"] for h in ev.hosts}
    images = images_seen(ev)
    note = " (one node: real production is multi-node)" if len(ev.hosts) == 1 else ""
    same = f"{len(ev.hosts)} node(s) on driver {next(iter(drivers))} and {next(iter(images.values()))}{note}"
    same += _same_build(ev)
    if gaps := evidence_gaps(ev):
        return result("node_consistency", INCONCLUSIVE, f"{'; '.join(gaps)}; otherwise {same}", files, **details)
    return result("node_consistency", PASS, same, files, **details)


def _host_differences(ev: Evidence) -> list[str]:
    """Drivers and container tags of the inventoried nodes (and --image) that differ or are not recorded."""
    problems = []
    drivers = {h["node"]: h["driver_version"] for h in ev.hosts}
    if len(set(drivers.values())) > 1:
        problems.append("nodes differ in driver: " + ", ".join(f"{n} {d}" for n, d in drivers.items()))
    missing = [h["node"] for h in ev.hosts if not h.get("container_image")]
    if missing:
        problems.append(f"container tag not recorded for {', '.join(missing)}")
    images = images_seen(ev)
    if len({normalise_image(i) for i in images.values()}) > 1:
        problems.append("nodes differ in container tag: " + ", ".join(f"{w} {i}" for w, i in images.items()))
    return problems


def _same_build(ev: Evidence) -> str:
    """", vLLM 0.27.1 and CUDA 13.0 build on n01, n02" when named nodes gave their collect-env."""
    named = [c for c in containers(ev) if c.node]
    if not named:
        return ""
    vllm, cuda = (named[0].facts.get(k) or "not collected" for k in ("vllm_version", "cuda_build"))
    return f", vLLM {vllm} and CUDA {cuda} build on {', '.join(str(c.node) for c in named)}"
