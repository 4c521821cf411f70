"""Pillar 1, compatibility: cross-check container, hosts and server against a versioned recipe.

    from k3load.precheck import run_precheck, recheck
    compat = run_precheck(Path("runs/r1"), Path("recipes/kimi-k3.yaml"), "http://10.0.0.5:8000",
                          container_info=Path("collect-env.txt"), host_inventories=[Path("n01.json")],
                          startup_log=Path("vllm.log"), image="vllm/vllm-openai:kimi-k3")
    compat["status"]   # "pass" | "fail" | "inconclusive"
    # a multi-node K3: each node's startup log and collect-env, as NODE=PATH (k3load.precheck.node_files)
    run_precheck(..., startup_log=["n01=n01.log", "n02=n02.log"], container_info=["n01=n01-env.txt", ...])

Why two steps (gather, then judge the copies): everything read is saved under DIR/evidence first and
the rules see only those copies, so `recheck(DIR)` gives the same rule results offline, on any machine.
Writes DIR/evidence/ and DIR/compat.json (atomically). The API key (and gateway headers: `secrets=`)
is only ever sent as a header and redacted from everything saved; `tls=` sets the trust for https.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3load.client.access import Secrets, Tls
from k3load.errors import InputError
from k3load.precheck.evidence import EVIDENCE, Gatherer, gather_files, gather_local_nvml, gather_server, load_evidence
from k3load.precheck.formats import EvidenceFormatError, check_input_files, inventory_nodes
from k3load.precheck.node_files import NodeFiles, NodeFilesError, as_node_files, unknown_nodes
from k3load.precheck.recipe import Recipe, RecipeError, load_recipe
from k3load.precheck.report import build_compat, write_compat
from k3load.precheck.rules import evaluate

__all__ = ["EvidenceFormatError", "PrecheckError", "RecipeError", "recheck", "run_precheck"]
SAVED_RECIPE = "recipe.yaml"


NodeFileInput = NodeFiles | Path | str | list[str] | list[Path] | None


class PrecheckError(InputError):
    """An input the precheck cannot use (a file that does not exist): nothing was judged. A file that is
    not its format raises EvidenceFormatError (k3load.precheck.formats), naming the file and the field."""


def _check_inputs(out_dir: Path, **paths: Path | list[Path] | tuple[Path, ...] | None) -> None:
    """Every input exists and lies outside DIR/evidence (which is replaced before copying)."""
    evidence = (out_dir / EVIDENCE).resolve()
    for flag, value in paths.items():
        for path in value if isinstance(value, list | tuple) else [value]:
            if path is None:
                continue
            if not Path(path).is_file():
                raise PrecheckError(f"--{flag.replace('_', '-')}: {path}: no such file")
            if Path(path).resolve().is_relative_to(evidence):
                raise PrecheckError(f"--{flag.replace('_', '-')}: {path} is inside {out_dir / EVIDENCE}, which a "
                                    "new precheck replaces: use --recheck, or copy the file out first")


def judge(out_dir: Path, recipe: Recipe) -> dict[str, Any]:
    """Evaluate the saved evidence under DIR/evidence against a recipe; write and return compat.json."""
    ev = load_evidence(out_dir, recipe.platform)
    compat = build_compat(recipe, ev, evaluate(recipe, ev), out_dir)
    write_compat(out_dir, compat)
    return compat


def _node_files(container_info: NodeFileInput, startup_log: NodeFileInput,
                host_inventories: list[Path] | tuple[Path, ...]) -> tuple[NodeFiles, NodeFiles]:
    """Both per-node options read (a bare path: one unnamed node); a malformed entry, or a node that no
    given inventory names, is a PrecheckError naming the option."""
    try:
        files = (as_node_files(container_info, "--container-info"), as_node_files(startup_log, "--startup-log"))
    except NodeFilesError as exc:
        raise PrecheckError(str(exc)) from None
    nodes = inventory_nodes(list(host_inventories))  # each read as its format: a bad one is named first
    for given in files:
        if problem := unknown_nodes(given, nodes):
            raise PrecheckError(problem)
    return files


def run_precheck(out_dir: Path, recipe_path: Path, base_url: str | None, *, container_info: NodeFileInput = None,
                 host_inventories: list[Path] | tuple[Path, ...] = (), startup_log: NodeFileInput = None,
                 image: str | None = None, custom_build: Path | None = None, api_key: str | None = None,
                 use_local_nvml: bool = True, metrics_url: str | None = None, secrets: Secrets | None = None,
                 tls: Tls | None = None) -> dict[str, Any]:
    """Gather the evidence into DIR/evidence, judge it, write DIR/compat.json and return its content.
    `metrics_url`: where the engine's /metrics is when not at `base_url` (the first --k3-metrics-url).
    `container_info`, `startup_log`: one path (a single node), or NODE=PATH entries, one per node (as
    NodeFiles, or their text: k3load.precheck.node_files), each node's judged on its own."""
    out_dir = Path(out_dir)
    recipe = load_recipe(recipe_path)  # first: a bad recipe must not leave a half-gathered record
    _check_inputs(out_dir, host_inventory=list(host_inventories), custom_build=custom_build)
    container_info, startup_log = _node_files(container_info, startup_log, host_inventories)
    _check_inputs(out_dir, container_info=container_info.paths(), startup_log=startup_log.paths())
    # each file read as its format before DIR/evidence is replaced: one that is not is an input error
    check_input_files(container_info=container_info.paths(), host_inventories=host_inventories,
                      custom_build=custom_build)
    secrets = secrets or Secrets(api_key)
    g = Gatherer(out_dir, secrets)
    g.copy(recipe.path, SAVED_RECIPE)
    gather_files(g, container_info=container_info, host_inventories=host_inventories, startup_log=startup_log,
                 image=image, custom_build=custom_build)
    if use_local_nvml:
        gather_local_nvml(g, image)
    else:
        g.note("no local NVML: --no-nvml")
    if base_url:
        gather_server(g, base_url, None, metrics_url=metrics_url, secrets=secrets, tls=tls)
    g.finish()
    return judge(out_dir, recipe)


def recheck(out_dir: Path, recipe_path: Path | None = None) -> dict[str, Any]:
    """Judge a saved DIR/evidence again (offline) with the given recipe, or the copy saved with it."""
    out_dir = Path(out_dir)
    path = Path(recipe_path) if recipe_path is not None else out_dir / EVIDENCE / SAVED_RECIPE
    if not (out_dir / EVIDENCE).is_dir():
        raise PrecheckError(f"{out_dir}: no {EVIDENCE}/ folder to recheck")
    return judge(out_dir, load_recipe(path))

