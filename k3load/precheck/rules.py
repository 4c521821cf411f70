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
from k3load.precheck.recipe import Recipe
from k3load.precheck.rule_base import files_of, na_result, option, result
from k3load.precheck.server_rules import metrics_gap, metrics_reachable, server_reachable, target_not_sim
from k3load.precheck.startup_log import cuda_init_problems, quote

CUSTOM_REQUIRED = ("commit", "pytorch_deps", "build_time", "reproduction", "rollback_image")
CUSTOM_OPTIONAL = ("image", "vllm_source", "cuda", "notes")
__all__ = ["FAIL", "INCONCLUSIVE", "NA", "PASS", "evaluate", "overall", "result"]


def _host_files(ev: Evidence) -> list[str]:
    return [h["file"] for h in ev.hosts]


def _no_hosts_why(ev: Evidence) -> str:
    nvml = next((n for n in ev.notes if n.startswith("no local NVML")), "local NVML not used (--no-nvml / "
                "--k3-nvml off)")
    return f"no {option('host-inventory')} and {nvml}"


# -- vLLM version --------------------------------------------------------------------------------------------
def _seen_versions(ev: Evidence) -> dict[str, str]:
    seen = {}
    if ev.server and ev.server["version"]:
        seen["/version"] = str(ev.server["version"])
    if ev.container and ev.container["vllm_version"]:
        seen["collect-env"] = ev.container["vllm_version"]
    if ev.startup and ev.startup["vllm_version"]:
        seen["startup log"] = ev.startup["vllm_version"]["value"]
    return seen


def _pin(version: dict[str, Any], text: str, ev: Evidence) -> tuple[bool, str]:
    """(pinned, source): a release is pinned by its public tag; a dev build only by a clean git sha."""
    sha = version["sha"] or (ev.container or {}).get("vllm_git_sha")
    record = (ev.custom_build or {}).get("record")
    commit = record.get("commit") if isinstance(record, dict) else None
    if version["dev"] or version["sha"]:
        if sha is None and commit is None:
            return False, f"dev build {text} without a git sha"
        if version["dirty"] or (ev.container or {}).get("vllm_local_changes"):
            return False, f"dev build {text} with uncommitted local changes (git sha {sha})"
        return True, f"git sha {sha or commit}"
    where = f"image {ev.image}" if ev.image else "the public release"
    return True, f"release {'.'.join(map(str, version['release']))} from {where}"


def vllm_version(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """Exact, agreed and recent enough: the same version everywhere it was seen, pinned, >= the minimum."""
    spec = recipe.section("vllm")
    files = files_of(ev, "server_version", "container", "startup")
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
def normalise_image(image: str) -> str:
    """repository:tag without registry default, library/ prefix or @sha256 digest (compared by tag)."""
    name = image.strip().split("@", 1)[0]
    for prefix in ("docker.io/", "index.docker.io/", "registry-1.docker.io/"):
        name = name.removeprefix(prefix)
    return name.removeprefix("library/")


def _images(ev: Evidence) -> dict[str, str]:
    seen = {"--image": ev.image} if ev.image else {}
    seen.update({f"node {h['node']}": h["container_image"] for h in ev.hosts if h.get("container_image")})
    return seen


def image_official(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """The deployed container is the recipe's image; a custom build never counts as it."""
    if skip := na_result(recipe, "image_official", "image"):
        return skip
    official = recipe.section("image")["official"]
    files = files_of(ev, "image", "custom_build") + _host_files(ev)
    if ev.custom_build is not None:
        return result("image_official", FAIL, f"custom build declared (evidence/{ev.custom_build['file']}): a custom "
                      f"build never passes as the official image {', '.join(official)}", files)
    seen = _images(ev)
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


def cuda_build(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """CUDA build from collect-env inside the container — never from nvidia-smi's 'CUDA Version'."""
    if skip := na_result(recipe, "cuda_build", "cuda"):
        return skip
    need = recipe.section("cuda")["build_major"]
    files = files_of(ev, "container", "custom_build")
    custom = " (custom build declared: see custom_build)" if ev.custom_build is not None else ""
    c = ev.container
    if c is None:
        return result("cuda_build", FAIL, f"no CUDA {need} build info: no collect-env output saved "
                      f"({option('container-info')}){_driver_max_hint(ev)}", files + _host_files(ev))
    torch = c["torch_version"] or "PyTorch not collected"
    if c["cuda_build"] is None:
        return result("cuda_build", FAIL, f"no CUDA {need} build info: collect-env has no 'CUDA used to build "
                      f"PyTorch' ({torch}){_driver_max_hint(ev)}{custom}", files)
    if major(c["cuda_build"]) != need:
        return result("cuda_build", FAIL, f"container built with CUDA {c['cuda_build']} ({torch}); the recipe "
                      f"needs a CUDA {need} build{custom}", files)
    if c["cuda_runtime"] is not None and major(c["cuda_runtime"]) != need:
        return result("cuda_build", FAIL, f"PyTorch built with CUDA {c['cuda_build']} but the container's CUDA "
                      f"runtime is {c['cuda_runtime']}{custom}", files)
    if str(c["cuda_available"]).lower() in ("false", "no"):
        return result("cuda_build", FAIL, f"CUDA {c['cuda_build']} build ({torch}), but CUDA does not initialise "
                      f"inside the container (Is CUDA available: {c['cuda_available']}; driver "
                      f"{c['driver_version'] or 'not collected'}){custom}", files)
    runtime = f", CUDA runtime {c['cuda_runtime']}" if c["cuda_runtime"] else ", CUDA runtime not collected"
    return result("cuda_build", PASS, f"CUDA {c['cuda_build']} build ({torch}{runtime}){custom}", files)


# -- hosts: driver, GPUs, consistency ------------------------------------------------------------------------
def driver_branch(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """Every host's driver branch >= the recipe's (R580 for CUDA 13); the container must see the same."""
    if skip := na_result(recipe, "driver_branch", "driver"):
        return skip
    need = recipe.section("driver")["min_branch"]
    files = _host_files(ev) + files_of(ev, "container")
    inside = (ev.container or {}).get("driver_version")
    if not ev.hosts:
        seen = f"; collect-env saw driver {inside} inside the container, but no host was inventoried" if inside else ""
        return result("driver_branch", FAIL, f"no NVIDIA driver recorded on any host: {_no_hosts_why(ev)}{seen}",
                      files)
    problems = [f"{h['node']}: no driver_version" for h in ev.hosts if not h["driver_version"]]
    for h in ev.hosts:
        branch = major(h["driver_version"])
        if h["driver_version"] and (branch is None or branch < need):
            problems.append(f"{h['node']} driver {h['driver_version']} (R{branch}) is below R{need}: a fail, not "
                            "'probably works'")
    drivers = {h["driver_version"] for h in ev.hosts if h["driver_version"]}
    if inside and inside not in drivers:
        problems.append(f"collect-env saw driver {inside} inside the container, the hosts report "
                        f"{', '.join(sorted(drivers))}: the container info is from another host")
    if problems:
        return result("driver_branch", FAIL, "; ".join(problems), files)
    listed = ", ".join(f"{h['node']} {h['driver_version']}" for h in ev.hosts)
    return result("driver_branch", PASS, f"R{need}+ on every node: {listed}", files)


def gpu_count(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """At least the recipe's GPU count across the inventoried nodes."""
    if skip := na_result(recipe, "gpu_count", "gpu"):
        return skip
    need = recipe.section("gpu")["min_count"]
    files = _host_files(ev)
    if not ev.hosts:
        return result("gpu_count", FAIL, f"GPU count not recorded: {_no_hosts_why(ev)}", files)
    per_node = ", ".join(f"{h['node']}: {h['gpu_count']}" for h in ev.hosts)
    if any(h["gpu_count"] is None for h in ev.hosts):
        return result("gpu_count", FAIL, f"GPU count missing for a node ({per_node})", files)
    total = sum(h["gpu_count"] for h in ev.hosts)
    if total < need:
        return result("gpu_count", FAIL, f"{total} GPUs ({per_node}); the recipe needs at least {need}", files)
    return result("gpu_count", PASS, f"{total} GPUs across {len(ev.hosts)} node(s) ({per_node}) >= {need}", files)


def gpu_model(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """Every GPU is one of the recipe's models (GB300-class for K3)."""
    if skip := na_result(recipe, "gpu_model", "gpu"):
        return skip
    models = recipe.section("gpu")["models"]
    files = _host_files(ev)
    names = {(h["node"], n) for h in ev.hosts for n in h["gpu_names"]}
    if not names:
        return result("gpu_model", FAIL, f"GPU models not recorded: {_no_hosts_why(ev)}" if not ev.hosts
                      else "GPU models not recorded in the host inventories", files)
    wrong = sorted({f"{n} ({node})" for node, n in names if not any(m.lower() in n.lower() for m in models)})
    if wrong:
        return result("gpu_model", FAIL, f"not {'/'.join(models)}-class: {', '.join(wrong)}", files)
    return result("gpu_model", PASS, f"all GPUs are {', '.join(sorted({n for _, n in names}))}", files)


def node_consistency(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """All nodes run the same driver and the same container tag (and --image agrees with them)."""
    if skip := na_result(recipe, "node_consistency", "driver"):
        return skip
    files = _host_files(ev) + files_of(ev, "image")
    if not ev.hosts:
        return result("node_consistency", INCONCLUSIVE, f"no nodes to compare: {_no_hosts_why(ev)}", files)
    problems = []
    drivers = {h["node"]: h["driver_version"] for h in ev.hosts}
    if len(set(drivers.values())) > 1:
        problems.append("nodes differ in driver: " + ", ".join(f"{n} {d}" for n, d in drivers.items()))
    missing = [h["node"] for h in ev.hosts if not h.get("container_image")]
    if missing:
        problems.append(f"container tag not recorded for {', '.join(missing)}")
    images = _images(ev)
    if len({normalise_image(i) for i in images.values()}) > 1:
        problems.append("nodes differ in container tag: " + ", ".join(f"{w} {i}" for w, i in images.items()))
    if problems:
        return result("node_consistency", FAIL, "; ".join(problems), files)
    note = " (one node: real production is multi-node)" if len(ev.hosts) == 1 else ""
    return result("node_consistency", PASS, f"{len(ev.hosts)} node(s) on driver {next(iter(drivers.values()))} "
                  f"and {next(iter(images.values()))}{note}", files)


# -- server configuration and startup log --------------------------------------------------------------------
def _same(value: Any, required: Any) -> bool:
    return str(value).strip().lower() == str(required).strip().lower()


def _flag_value(flag: str, ev: Evidence) -> tuple[Any, str] | None:
    """(value, where) of one server option; None when no evidence can tell."""
    cache = (ev.server or {}).get("cache_config") or {}
    if flag == "enable_prefix_caching" and "enable_prefix_caching" in cache:
        return cache["enable_prefix_caching"], "vllm:cache_config_info"
    args = (ev.startup or {}).get("args") or {}
    if flag in args:
        return args[flag], "startup log non-default args"
    if args and flag != "enable_prefix_caching":  # absent from non-default args: vLLM's default (off/None)
        return None, "not among the startup log's non-default args"
    return None


def serve_flags(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """The recipe's server options are in effect: read from what the server reports, not from a launch script."""
    required = recipe.section("serve")["required"]
    files = files_of(ev, "server_metrics", "startup")
    wrong, unknown, good = [], [], []
    for flag, want in required.items():
        seen = _flag_value(flag, ev)
        if seen is None:
            unknown.append(flag)
        elif not _same(seen[0], want):
            value = "not set" if seen[0] is None else f"is {seen[0]}"
            wrong.append(f"{flag} {value} ({seen[1]}), needs {want}")
        else:
            good.append(f"{flag}={want}")
    if wrong:
        return result("serve_flags", FAIL, "; ".join(wrong), files)
    if unknown:
        gap = metrics_gap(ev) if ev.server is not None else None
        return result("serve_flags", INCONCLUSIVE, (f"inconclusive, because {gap}; " if gap else "")
                      + "not readable from /metrics or a startup log: "
                      f"{', '.join(unknown)}" + (f" (confirmed: {', '.join(good)})" if good else ""), files)
    return result("serve_flags", PASS, ", ".join(good), files)


def startup_log(recipe: Recipe, ev: Evidence) -> dict[str, Any]:
    """No NCCL, communication or kernel warnings; on CUDA, initialisation, NCCL and kernels seen. Known
    configuration notices (--enforce-eager and the like, startup_log.NOTICES) are named, not judged."""
    log = ev.startup
    if log is None:
        return result("startup_log", INCONCLUSIVE, f"no startup log saved ({option('startup-log')}): CUDA "
                      "initialisation, communication backend and kernel loading not checked")
    files = files_of(ev, "startup")
    details = {"flagged": log["flagged"], "other_warnings": log["other_warnings"]}
    fails, gaps = cuda_init_problems(log) if recipe.platform == "cuda" else ([], [])
    if log["flagged"]:
        fails.insert(0, f"{len(log['flagged'])} NCCL/communication/kernel warning(s): {quote(log['flagged'])}")
    if fails:
        return result("startup_log", FAIL, "; ".join(fails), files, **details)
    notes = sorted({w["notice"] for w in log["other_warnings"] if w.get("notice")})
    noted = f"; noted, not judged: {'; '.join(notes)}" if notes else ""
    if gaps:
        return result("startup_log", INCONCLUSIVE, "; ".join(gaps) + noted, files, **details)
    seen = [f"{k} {(log[k] or {}).get('value')}" for k in ("device", "comm_backend", "nccl_version") if log[k]]
    other = f"; {len(log['other_warnings'])} other warning(s), not about compatibility" if log["other_warnings"] else ""
    return result("startup_log", PASS, f"no NCCL, communication or kernel warnings in {log['lines']} lines"
                  f"{'; ' + ', '.join(seen) if seen else ''}{other}{noted}", files, **details)


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
    sha = (ev.container or {}).get("vllm_git_sha")
    commit = str(r["commit"])
    if sha and not (commit.startswith(sha) or sha.startswith(commit)):
        return result("custom_build", FAIL, f"the container's vLLM git sha {sha} is not the recorded commit {commit}",
                      [cb["file"], *files_of(ev, "container")])
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
