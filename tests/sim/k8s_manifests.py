"""The Kubernetes example under docs/kubernetes/ as its tests read it, shared by their files: its YAML documents,
the manifests rendered as `kubectl apply -k` would (kustomization.yaml's resources, namespace and images), a
container's command line through the real Locust + k3load parser, and gather.sh run as the `gather` init
container runs it, against a stand-in kubectl that answers as a two-node cluster would (issue 26 item 5)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "kubernetes"
DEFAULT_MASTER_PORT = 5557  # Locust's --master-port / --master-bind-port default


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(EXAMPLE.rglob("*.yaml")):
        docs += [(str(path.relative_to(ROOT)), doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


DOCS = _documents()
KUSTOMIZATION = yaml.safe_load((EXAMPLE / "manifests" / "kustomization.yaml").read_text())


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def _render() -> list[dict[str, Any]]:
    """The manifests as `kubectl apply -k` applies them: the kustomization's resources, its namespace on every
    namespaced object (and on the ServiceAccount subjects of the bindings), its images on every container."""
    images = {i["name"]: i for i in KUSTOMIZATION.get("images", [])}
    rendered = []
    for resource in KUSTOMIZATION["resources"]:
        for doc in yaml.safe_load_all((EXAMPLE / "manifests" / resource).read_text()):
            if not doc:
                continue
            if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
                doc["metadata"]["namespace"] = KUSTOMIZATION["namespace"]
            for subject in doc.get("subjects", []):
                subject["namespace"] = KUSTOMIZATION["namespace"]
            for container in _containers(doc):
                name, _, tag = container["image"].partition(":")
                if name in images:
                    new = images[name]
                    container["image"] = f"{new.get('newName', name)}:{new.get('newTag', tag)}"
            rendered.append(doc)
    return rendered


RENDERED = _render() + [d for w, d in DOCS if d["kind"] == "Secret"]  # the Secret is created by hand


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in RENDERED if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _parser() -> Any:
    from locust.argument_parser import get_parser

    from k3load.loadgen.options import add_options

    parser = get_parser(default_config_files=[])
    add_options(parser)
    return parser


def _container(workload: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """The workload's one container, or its container or init container `name`."""
    if name is None:
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        return container
    (container,) = [c for c in _containers(workload) if c["name"] == name]
    return container


def _options(container: dict[str, Any], mounts: dict[str, Path] | None = None) -> argparse.Namespace:
    """The container's command line through the real parser (an unknown option exits: a failure here).
    `mounts`: a mount path -> the local folder standing for the volume there (the args are read through it)."""
    command, args = container["command"], list(container["args"])
    assert command[:2] == ["locust", "-f"] and (ROOT / command[2]).is_file(), command
    for mount, local in (mounts or {}).items():
        args = [str(local) + a[len(mount):] if a == mount or a.startswith(mount + "/") else a for a in args]
    return _parser().parse_args(command[1:] + args)


def _mount_of(container: dict[str, Any], pod: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume whose mount holds `path`."""
    mounts = [m for m in container["volumeMounts"] if PurePosixPath(path).is_relative_to(m["mountPath"])]
    assert len(mounts) == 1, (path, container["volumeMounts"])
    return next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])


# -- gather.sh against a stand-in kubectl --------------------------------------------------------------------
PRECHECK = ROOT / "tests" / "data" / "precheck"
PODS = {"vllm-0": "gb300-n01", "vllm-1": "gb300-n02"}  # the serving pods and the nodes they run on
NODES = tuple(PODS.values())
SAME_DRIVER = dict.fromkeys(NODES, "580.95.05")
MIXED_DRIVERS = {"gb300-n01": "580.95.05", "gb300-n02": "580.105.08"}  # one K3 on two driver patch levels
SERVING_IMAGE = "vllm/vllm-openai:kimi-k3"
COLLECT_ENV = PRECHECK / "collect-env" / "cu130-gb300.txt"  # what `vllm collect-env` prints on a GB300
STARTUP_LOG = PRECHECK / "logs" / "k3-clean.log"
FAKE_KUBECTL = r"""#!{python}
# A stand-in kubectl: answers gather.sh's calls as a two-node cluster would, and records each call.
import json, os, re, sys
args = sys.argv[1:]
with open(os.environ["KUBECTL_CALLS"], "a") as calls:
    calls.write(json.dumps(args) + "\n")
pods = json.loads(os.environ["FAKE_PODS"])  # pod -> node
drivers = json.loads(os.environ["FAKE_DRIVERS"])  # node -> driver version
deployment_image = os.environ["FAKE_DEPLOYMENT_IMAGE"]
if args[0] == "logs":
    log = open(os.environ["FAKE_STARTUP_LOG"]).read()
    if args[3] in os.environ["FAKE_ROTATED"].split():  # the kubelet rotated the start-up lines away
        log = log[log.index("non-default args: "):].split("\n", 1)[1]
    sys.stdout.write(log)
elif args[0] == "exec":
    pod, command = args[3], args[args.index("--") + 1:]
    if os.environ["FAKE_EXEC_FORBIDDEN"]:
        sys.exit(f'Error from server (Forbidden): pods "{{pod}}" is forbidden: cannot create resource "pods/exec"')
    if command == ["vllm", "collect-env"] and pod in os.environ["FAKE_NO_CLI"].split():
        sys.exit("vllm: error: argument subparser: invalid choice: 'collect-env'")
    if command not in (["vllm", "collect-env"], ["python3", "-m", "vllm.collect_env"]):
        sys.exit(f"stand-in kubectl: unexpected exec {{command}}")
    text = open(os.environ["FAKE_COLLECT_ENV"]).read()  # the driver its node's container sees
    sys.stdout.write(re.sub(r"(?m)^(Nvidia driver version\s*: ).*$", lambda m: m[1] + drivers[pods[pod]], text))
elif args[:2] == ["get", "deployment"]:
    print(deployment_image)
elif args[:2] == ["get", "pods"]:
    print("\n".join(f"{{pod}} {{node}}" for pod, node in pods.items()))
elif args[:2] == ["get", "pod"]:
    print(deployment_image)
elif args[:2] == ["get", "node"]:
    major, minor, rev = drivers[args[2]].split(".")
    labels = {{"nvidia.com/cuda.driver.major": major, "nvidia.com/cuda.driver.minor": minor,
              "nvidia.com/cuda.driver.rev": rev, "nvidia.com/gpu.count": "4", "nvidia.com/gpu.product": "NVIDIA-GB300",
              "nvidia.com/gpu.memory": "284208", "nvidia.com/cuda.runtime.major": "13",
              "nvidia.com/cuda.runtime.minor": "0"}}
    print(json.dumps({{"kind": "Node", "metadata": {{"name": args[2], "labels": labels}}}}))
else:
    sys.exit(f"stand-in kubectl: unexpected call {{args}}")
"""


def _env_value(env: dict[str, Any]) -> str:
    """An env entry's value as the kubelet would set it in the rendered Job's pod."""
    if "value" in env:
        return env["value"]
    field = env["valueFrom"]["fieldRef"]["fieldPath"]
    return {"metadata.namespace": KUSTOMIZATION["namespace"], "metadata.name": "k3load-master-x7k2p"}[field]


def _run_gather(tmp: Path, drivers: dict[str, str] = SAME_DRIVER, rotated: tuple[str, ...] = (),
                no_cli: tuple[str, ...] = ("vllm-1",), exec_forbidden: bool = False,
                **env_overrides: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """gather.sh from the ConfigMap, run as the `gather` init container runs it, with the stand-in kubectl.
    `rotated`: pods whose log lost its start-up lines; `no_cli`: pods whose vllm CLI lacks `collect-env`."""
    gather = _container(_one("Job"), "gather")
    script = _one("ConfigMap", "k3load-evidence")["data"]["gather.sh"]
    bin_dir, evidence = tmp / "bin", tmp / "evidence"
    bin_dir.mkdir(parents=True, exist_ok=True)
    evidence.mkdir(exist_ok=True)
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(FAKE_KUBECTL.format(python=sys.executable))
    kubectl.chmod(0o755)
    env = {e["name"]: _env_value(e) for e in gather["env"]}
    env.update(env_overrides)
    env.update(EVIDENCE_DIR=str(evidence), KUBECTL_CALLS=str(tmp / "calls.jsonl"), FAKE_DEPLOYMENT_IMAGE=SERVING_IMAGE,
               FAKE_PODS=json.dumps(PODS), FAKE_DRIVERS=json.dumps(drivers), FAKE_ROTATED=" ".join(rotated),
               FAKE_NO_CLI=" ".join(no_cli), FAKE_EXEC_FORBIDDEN="1" if exec_forbidden else "",
               FAKE_STARTUP_LOG=str(STARTUP_LOG), FAKE_COLLECT_ENV=str(COLLECT_ENV),
               PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]))
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    return done, evidence


def _calls(tmp: Path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp / "calls.jsonl").read_text().splitlines()]


def _mount_path(container: dict[str, Any], volume: str) -> str:
    (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume]
    return mount


def _master_options(evidence: Path) -> argparse.Namespace:
    """The master's options with the evidence volume standing at `evidence` (its --config read from there)."""
    master = _container(_one("Job"))
    return _options(master, {_mount_path(master, "evidence"): evidence})
