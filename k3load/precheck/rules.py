"""The compatibility rules: pure functions of (recipe, evidence) -> one result each.

Why these rules and their strictness: the acceptance criteria list the mismatches that send a
deployment back to `rebuild` (image not the K3 one, CUDA 13 build info not saved, driver below R580 —
an R575 host is a fail, not "probably works" —, vLLM version or source not pinned, nodes differing in
driver or container tag, NCCL/communication/kernel warnings in the startup log). Evidence that was not
saved counts as missing, never as "probably fine"; a rule that could not look (no server, no log) is
`inconclusive`. Each result: {"id", "status", "reason", "evidence": [paths relative to DIR/evidence/],
"details"}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from k3load.outcomes import FAIL, INCONCLUSIVE, PASS
from k3load.outcomes import NOT_APPLICABLE as NA
from k3load.precheck.collect_env import major, parse_version, version_at_least
from k3load.precheck.evidence import Evidence
from k3load.precheck.node_evidence import NodeFacts, containers, missing_nodes, startups
from k3load.precheck.node_rules import container_value, images_seen, node_consistency, normalise_image, not_given
from k3load.precheck.recipe import Recipe
from k3load.precheck.rule_base import files_of, host_files, na_result, no_hosts_why, option, result
from k3load.precheck.server_rules import metrics_reachable, server_reachable, target_not_sim
from k3load.precheck.startup_rules import serve_flags, startup_log

CUSTOM_REQUIRED = ("commit", "pytorch_deps", "build_time", "reproduction", "rollback_image")
CUSTOM_OPTIONAL = ("image", "vllm_source", "cuda", "notes")
__all__ = ["FAIL", "INCONCLUSIVE", "NA", "PASS", "evaluate", "overall", "result"]


# -- vLLM version --------------------------------------------------------------------------------------------
def _seen_versions(ev: Evidence) -> dict[str, str]:
    """Where each vLLM version was seen: /version, each node's collect-env and startup log (a named node's
    as "collect-env n01")."""
    seen = {}
    if ev.server and ev.server["version"]:
        seen["/version"] = str(ev.server["version"])
    for c in containers(ev):
        if c.facts["vllm_version"]:
            seen[_seen_at("collect-env", c)] = c.facts["vllm_version"]
    for log in startups(ev):
        if log.facts["vllm_version"]:
            seen[_seen_at("startup log", log)] = log.facts["vllm_version"]["value"]
    return seen


def _seen_at(kind: str, given: NodeFacts) -> str:
    return f"{kind} {given.node}" if given.node else kind


def _node_files(ev: Evidence) -> list[str]:
    """Every node's collect-env and startup log under DIR/evidence."""
    return [c.file for c in containers(ev)] + [log.file for log in startups(ev)]


def _pin(version: dict[str, Any], text: str, ev: Evidence) -> tuple[bool, str]:
    """(pinned, source): a release is pinned by its public tag; a dev build only by a clean git sha."""
    sha = version["sha"] or container_value(ev, "vllm_git_sha")
    record = (ev.custom_build or {}).get("record")
    commit = record.get("commit") if isinstance(record, dict) else None
    if version["dev"] or version["sha"]:
        if sha is None and commit is None:
            return False, f"dev build {text} without a git sha"
        if version["dirty"] or container_value(ev, "vllm_local_changes"):
            return False, f"dev build {text} with uncommitted local changes (git sha {sha})"
        return True, f"git sha {sha or commit}"
    where = f"image {ev.image}" if ev.image else "the public release"
    return True, f"release {'.'.join(map(str, version['release']))} from {where}"


def vllm_version(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """Exact, agreed and recent enough: the same version everywhere it was seen, pinned, >= the minimum."""
    spec = recipe.section("vllm")
    files = files_of(ev, "server_version") + _node_files(ev)
    seen = _seen_versions(ev)
    if not seen:
        return result("vllm_version", FAIL, "vLLM version not recorded (no /version, collect-env or startup log)")
    if len(set(seen.values())) > 1:
        listed = ", ".join(f"{k} {v}" for k, v in seen.items())
        return result("vllm_version", FAIL, f"vLLM versions disagree ({listed}): the server is not the build "
                      "that was inspected", files, seen=seen)
    text = next(iter(seen.values()))
    version = parse_version(text)
    if version is None:
        return result("vllm_version", FAIL, f"vLLM version {text!r} is not an exact version (unpinned)", files)
    pinned, source = _pin(version, text, ev)
    where = ", ".join(seen)
    if spec.get("require_pinned", True) and not pinned:
        return result("vllm_version", FAIL, f"vLLM version not pinned: {source} (seen in {where})", files)
    if not version_at_least(version, spec["min_version"]):
        return result("vllm_version", FAIL, f"vLLM {text} is below the recipe's {spec['min_version']} "
                      f"(seen in {where})", files)
    return result("vllm_version", PASS, f"vLLM {text} >= {spec['min_version']}, pinned by {source} "
                  f"(seen in {where})", files, seen=seen, source=source)


# -- container: image and CUDA build -------------------------------------------------------------------------
def image_official(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """The deployed container is the recipe's image; a custom build never counts as it."""
    if skip := na_result(recipe, "image_official", "image"):
        return skip
    official = recipe.section("image")["official"]
    files = files_of(ev, "image", "custom_build") + host_files(ev)
    if ev.custom_build is not None:
        return result("image_official", FAIL, f"custom build declared (evidence/{ev.custom_build['file']}): a custom "
                      f"build never passes as the official image {', '.join(official)}", files)
    seen = images_seen(ev)
    if not seen:
        return result("image_official", FAIL, f"container image not recorded ({option('image')}, or container_image "
                      "in the host inventories)", files)
    accepted = {normalise_image(o) for o in official}
    wrong = {where: img for where, img in seen.items() if normalise_image(img) not in accepted}
    if wrong:
        listed = "; ".join(f"{img} ({where})" for where, img in wrong.items())
        return result("image_official", FAIL, f"not the K3 image {', '.join(official)}: {listed}", files)
    return result("image_official", PASS, f"{', '.join(sorted(set(seen.values())))} on {', '.join(seen)}", files)


def _driver_max_hint(ev: Evidence) -> str:
    seen = sorted({f"{h['cuda_driver_max_version']} on {h['node']}" for h in ev.hosts
                   if h.get("cuda_driver_max_version")})
    if not seen:
        return ""
    return (f"; the 'CUDA Version' from nvidia-smi/NVML ({', '.join(seen)}) is the driver's maximum, not the "
            "build, and never counts")


def _cuda_one(c: NodeFacts, need: int, ev: Evidence) -> tuple[bool, str]:
    """(passed, what) of one collect-env; a named node's said with its name."""
    f, at = c.facts, f"{c.where}: " if c.node else ""
    torch = f["torch_version"] or "PyTorch not collected"
    if f["cuda_build"] is None:
        return False, (f"{at}no CUDA {need} build info: collect-env has no 'CUDA used to build PyTorch' ({torch})"
                       f"{_driver_max_hint(ev)}")
    if major(f["cuda_build"]) != need:
        return False, f"{at}container built with CUDA {f['cuda_build']} ({torch}); the recipe needs a CUDA {need} build"
    if f["cuda_runtime"] is not None and major(f["cuda_runtime"]) != need:
        return False, f"{at}PyTorch built with CUDA {f['cuda_build']} but the container's CUDA runtime is " \
            f"{f['cuda_runtime']}"
    if str(f["cuda_available"]).lower() in ("false", "no"):
        return False, (f"{at}CUDA {f['cuda_build']} build ({torch}), but CUDA does not initialise inside the "
                       f"container (Is CUDA available: {f['cuda_available']}; driver "
                       f"{f['driver_version'] or 'not collected'})")
    runtime = f", CUDA runtime {f['cuda_runtime']}" if f["cuda_runtime"] else ", CUDA runtime not collected"
    return True, f"{at}CUDA {f['cuda_build']} build ({torch}{runtime})"


def cuda_build(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """CUDA build from collect-env inside the container — never from nvidia-smi's 'CUDA Version' — on every
    node that gave one; an inventoried node without one, when others have theirs, is named (inconclusive)."""
    if skip := na_result(recipe, "cuda_build", "cuda"):
        return skip
    need = recipe.section("cuda")["build_major"]
    given = containers(ev)
    files = [c.file for c in given] + files_of(ev, "custom_build")
    custom = " (custom build declared: see custom_build)" if ev.custom_build is not None else ""
    if not given:
        return result("cuda_build", FAIL, f"no CUDA {need} build info: no collect-env output saved "
                      f"({option('container-info')}){_driver_max_hint(ev)}", files + host_files(ev))
    judged = [_cuda_one(c, need, ev) for c in given]
    said = "; ".join(what for _, what in judged)
    if not all(ok for ok, _ in judged):
        return result("cuda_build", FAIL, "; ".join(what for ok, what in judged if not ok) + custom, files)
    if missing := missing_nodes(ev, given):
        return result("cuda_build", INCONCLUSIVE, f"{not_given(missing, 'collect-env', 'container-info')}; "
                      f"{said}{custom}", files + host_files(ev))
    return result("cuda_build", PASS, said + custom, files)


# -- hosts: driver, GPUs, consistency ------------------------------------------------------------------------
def driver_branch(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """Every host's driver branch >= the recipe's (R580 for CUDA 13); the container must see the same."""
    if skip := na_result(recipe, "driver_branch", "driver"):
        return skip
    need = recipe.section("driver")["min_branch"]
    files = host_files(ev) + [c.file for c in containers(ev)]
    inside = ", ".join(sorted({c.facts["driver_version"] for c in containers(ev) if c.facts["driver_version"]}))
    if not ev.hosts:
        seen = f"; collect-env saw driver {inside} inside the container, but no host was inventoried" if inside else ""
        return result("driver_branch", FAIL, f"no NVIDIA driver recorded on any host: {no_hosts_why(ev)}{seen}",
                      files)
    problems = [f"{h['node']}: no driver_version" for h in ev.hosts if not h["driver_version"]]
    for h in ev.hosts:
        branch = major(h["driver_version"])
        if h["driver_version"] and (branch is None or branch < need):
            problems.append(f"{h['node']} driver {h['driver_version']} (R{branch}) is below R{need}: a fail, not "
                            "'probably works'")
    problems += _inside_drivers(ev)
    if problems:
        return result("driver_branch", FAIL, "; ".join(problems), files)
    listed = ", ".join(f"{h['node']} {h['driver_version']}" for h in ev.hosts)
    return result("driver_branch", PASS, f"R{need}+ on every node: {listed}", files)


def _inside_drivers(ev: Evidence) -> list[str]:
    """The driver each collect-env saw inside its container against the hosts': a named node's against its
    own host's, the unnamed one's against every host's."""
    drivers = {h["node"]: h["driver_version"] for h in ev.hosts if h["driver_version"]}
    problems = []
    for c in containers(ev):
        inside = c.facts["driver_version"]
        if not inside:
            continue
        if c.node in drivers:
            if inside != drivers[c.node]:
                problems.append(f"{c.where}: collect-env saw driver {inside} inside the container, its host reports "
                                f"{drivers[c.node]}: the container info is from another host")
        elif inside not in set(drivers.values()):
            at = f"{c.where}: " if c.node else ""
            problems.append(f"{at}collect-env saw driver {inside} inside the container, the hosts report "
                            f"{', '.join(sorted(set(drivers.values())))}: the container info is from another host")
    return problems


def gpu_count(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """At least the recipe's GPU count across the inventoried nodes."""
    if skip := na_result(recipe, "gpu_count", "gpu"):
        return skip
    need = recipe.section("gpu")["min_count"]
    files = host_files(ev)
    if not ev.hosts:
        return result("gpu_count", FAIL, f"GPU count not recorded: {no_hosts_why(ev)}", files)
    per_node = ", ".join(f"{h['node']}: {h['gpu_count']}" for h in ev.hosts)
    if any(h["gpu_count"] is None for h in ev.hosts):
        return result("gpu_count", FAIL, f"GPU count missing for a node ({per_node})", files)
    total = sum(h["gpu_count"] for h in ev.hosts)
    if total < need:  # total: the deployment's GPUs, what the capacity plan sizes a replica by
    # (analysis/decision/capacity.py)
        return result("gpu_count", FAIL, f"{total} GPUs ({per_node}); the recipe needs at least {need}", files,
                      total=total, nodes=len(ev.hosts))
    return result("gpu_count", PASS, f"{total} GPUs across {len(ev.hosts)} node(s) ({per_node}) >= {need}", files,
                  total=total, nodes=len(ev.hosts))


def gpu_model(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """Every GPU is one of the recipe's models (GB300-class for K3)."""
    if skip := na_result(recipe, "gpu_model", "gpu"):
        return skip
    models = recipe.section("gpu")["models"]
    files = host_files(ev)
    names = {(h["node"], n) for h in ev.hosts for n in h["gpu_names"]}
    if not names:
        return result("gpu_model", FAIL, f"GPU models not recorded: {no_hosts_why(ev)}" if not ev.hosts
                      else "GPU models not recorded in the host inventories", files)
    wrong = sorted({f"{n} ({node})" for node, n in names if not any(m.lower() in n.lower() for m in models)})
    if wrong:
        return result("gpu_model", FAIL, f"not {'/'.join(models)}-class: {', '.join(wrong)}", files)
    return result("gpu_model", PASS, f"all GPUs are {', '.join(sorted({n for _, n in names}))}", files)


# -- custom build --------------------------------------------------------------------------------------------
def custom_build_problems(record: Any) -> list[str]:
    """What a custom build record lacks: commit, PyTorch deps, build time, reproduction, rollback image."""
    if not isinstance(record, dict):
        return ["not a mapping of fields"]
    missing = [k for k in CUSTOM_REQUIRED if record.get(k) in (None, "", [], {})]
    unknown = sorted(set(record) - set(CUSTOM_REQUIRED) - set(CUSTOM_OPTIONAL))
    return ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(unknown)}"] if unknown
                                                                       else [])


def custom_build(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """A custom build is recorded in full (its own section), and judged apart from the official image."""
    cb = ev.custom_build
    if cb is None:
        return result("custom_build", NA, f"not_applicable: no custom build declared ({option('custom-build')})")
    problems = [cb["error"]] if cb["error"] else custom_build_problems(cb["record"])
    if problems:
        return result("custom_build", FAIL, f"custom build record incomplete: {'; '.join(problems)}", [cb["file"]])
    r = cb["record"]
    commit = str(r["commit"])
    for c in containers(ev):
        sha = c.facts.get("vllm_git_sha")
        if sha and not (commit.startswith(sha) or sha.startswith(commit)):
            at = f" ({c.where})" if c.node else ""
            return result("custom_build", FAIL, f"the container's vLLM git sha {sha}{at} is not the recorded commit "
                          f"{commit}", [cb["file"], c.file])
    return result("custom_build", PASS, f"custom build recorded (commit {r['commit']}, built {r['build_time']}, "
                  f"rollback image {r['rollback_image']}); judged apart from the official image: see "
                  "image_official", [cb["file"]])


RULES: tuple[Callable[[Recipe, Evidence], dict[str, Any]], ...] = (
    server_reachable, metrics_reachable, target_not_sim, vllm_version, image_official, cuda_build, driver_branch,
    gpu_count, gpu_model, node_consistency, serve_flags, startup_log, custom_build)


def evaluate(recipe: Recipe, ev: Evidence) -> list[dict[str, Any]]:
    """Every rule, in a fixed order."""
    return [rule(recipe, ev) for rule in RULES]


def overall(results: list[dict[str, Any]]) -> str:
    """fail if any rule fails; inconclusive if none fails but one could not be decided; else pass."""
    statuses = {r["status"] for r in results}
    if FAIL in statuses:
        return FAIL
    return INCONCLUSIVE if INCONCLUSIVE in statuses else PASS
