"""The Kubernetes example under docs/kubernetes/: every YAML document valid against a schema of the fields it
uses (unknown keys rejected, so a typo fails here and not on a cluster), and the consistency a running
example depends on: the worker reaches the master's Service and port, every option on a container's
command line is one the real Locust + k3load parser accepts, the Secret and its keys exist, the results
volume holds --k3-out, and the plan in the ConfigMap is a valid plan whose families have scenarios.

The manifests are rendered as `kubectl apply -k` would (kustomization.yaml's resources, namespace and
images), and the precheck's wiring is checked on the rendered Job (issue 26 item 5): its `gather` init
container collects every input the compat rules need, gather.sh is run for real against a stand-in kubectl
that answers as a two-node cluster would (`kubectl exec POD -- vllm collect-env` with each node's own driver),
the files it writes are the files the master's options name (through the same volume, mounted in both), each
node's collect-env reaches its NODE=PATH and is judged against its own host, a pod whose start-up lines were
rotated away stops it with one line, every kubectl call it makes is one its roles allow, and the precheck
judged on what it wrote passes every rule that needs no server."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import yaml

from k3load.loadgen.inputs import check_inputs, load_inputs, node_files
from k3load.precheck import run_precheck

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "kubernetes"
DEFAULT_MASTER_PORT = 5557  # Locust's --master-port / --master-bind-port default

NAME = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
STRINGS = {"type": "array", "items": {"type": "string"}}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}


def _obj(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties, "additionalProperties": False}


METADATA = _obj(["name"], name=NAME, labels=LABELS)
SELECTOR = _obj(["matchLabels"], matchLabels=LABELS)
KEY_REF = _obj(["name", "key"], name=NAME, key={"type": "string"})
FIELD_REF = _obj(["fieldPath"], fieldPath={"enum": ["metadata.name", "metadata.namespace"]})
ENV = _obj(["name"], name={"type": "string", "pattern": "^[A-Z_][A-Z0-9_]*$"}, value={"type": "string"},
           valueFrom={"oneOf": [_obj(["secretKeyRef"], secretKeyRef=KEY_REF), _obj(["fieldRef"], fieldRef=FIELD_REF)]})
QUANTITIES = {"type": "object", "propertyNames": {"enum": ["cpu", "memory", "storage", "nvidia.com/gpu"]},
              "additionalProperties": {"type": "string"}}
CONTAINER = _obj(
    ["name", "image", "command"], name=NAME, image={"type": "string"}, command=STRINGS, args=STRINGS,
    env={"type": "array", "items": ENV},
    ports={"type": "array", "items": _obj(["containerPort"], name={"type": "string"}, containerPort=PORT,
                                          protocol={"enum": ["TCP"]})},
    volumeMounts={"type": "array", "items": _obj(["name", "mountPath"], name=NAME, mountPath={"type": "string"},
                                                 readOnly={"type": "boolean"})},
    resources=_obj([], requests=QUANTITIES, limits=QUANTITIES))
KEY_PATHS = {"type": "array", "items": _obj(["key", "path"], key={"type": "string"}, path={"type": "string"})}
PROJECTED = {"type": "array", "items": {"oneOf": [
    _obj(["serviceAccountToken"], serviceAccountToken=_obj(["path"], path={"const": "token"},
                                                           expirationSeconds={"type": "integer"})),
    _obj(["configMap"], configMap=_obj(["name"], name={"enum": ["kube-root-ca.crt"]}, items=KEY_PATHS)),
    _obj(["downwardAPI"], downwardAPI=_obj(["items"], items={"type": "array", "items": _obj(
        ["path", "fieldRef"], path={"type": "string"}, fieldRef=FIELD_REF)}))]}}
VOLUME = _obj(["name"], name=NAME, configMap=_obj(["name"], name=NAME),
              persistentVolumeClaim=_obj(["claimName"], claimName=NAME),
              emptyDir=_obj([], sizeLimit={"type": "string"}), projected=_obj(["sources"], sources=PROJECTED))
POD_SPEC = _obj(["containers"], containers={"type": "array", "minItems": 1, "items": CONTAINER},
                initContainers={"type": "array", "items": CONTAINER}, serviceAccountName=NAME,
                automountServiceAccountToken={"type": "boolean"},
                volumes={"type": "array", "items": VOLUME}, restartPolicy={"enum": ["Always", "Never", "OnFailure"]},
                terminationGracePeriodSeconds={"type": "integer", "minimum": 0},
                securityContext=_obj([], runAsNonRoot={"type": "boolean"}, runAsUser={"type": "integer"},
                                     fsGroup={"type": "integer"}))
TEMPLATE = _obj(["metadata", "spec"], metadata=_obj([], labels=LABELS), spec=POD_SPEC)


def _kind(api_version: str, kind: str, **properties: Any) -> dict[str, Any]:
    return _obj(["apiVersion", "kind", "metadata", *properties], apiVersion={"const": api_version},
                kind={"const": kind}, metadata=METADATA, **properties)


RBAC_RULES = {"type": "array", "minItems": 1, "items": _obj(
    ["apiGroups", "resources", "verbs"], apiGroups=STRINGS, resources=STRINGS, resourceNames=STRINGS,
    verbs={"type": "array", "items": {"enum": ["get", "list", "create"]}})}  # create: pods/exec only (a test)
ROLE_REF = _obj(["apiGroup", "kind", "name"], apiGroup={"const": "rbac.authorization.k8s.io"},
                kind={"enum": ["Role", "ClusterRole"]}, name=NAME)
SUBJECTS = {"type": "array", "items": _obj(["kind", "name"], kind={"const": "ServiceAccount"}, name=NAME,
                                           namespace=NAME)}
SCHEMAS = {
    "Kustomization": _obj(["apiVersion", "kind", "resources"], apiVersion={"const": "kustomize.config.k8s.io/v1beta1"},
                          kind={"const": "Kustomization"}, namespace=NAME, resources=STRINGS,
                          images={"type": "array", "items": _obj(["name"], name={"type": "string"},
                                                                 newName={"type": "string"},
                                                                 newTag={"type": "string"})}),
    "ServiceAccount": _kind("v1", "ServiceAccount", automountServiceAccountToken={"const": False}),
    "Role": _kind("rbac.authorization.k8s.io/v1", "Role", rules=RBAC_RULES),
    "ClusterRole": _kind("rbac.authorization.k8s.io/v1", "ClusterRole", rules=RBAC_RULES),
    "RoleBinding": _kind("rbac.authorization.k8s.io/v1", "RoleBinding", roleRef=ROLE_REF, subjects=SUBJECTS),
    "ClusterRoleBinding": _kind("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", roleRef=ROLE_REF,
                                subjects=SUBJECTS),
    "ConfigMap": _kind("v1", "ConfigMap", data={"type": "object", "additionalProperties": {"type": "string"}}),
    "Secret": _kind("v1", "Secret", type={"const": "Opaque"},
                    stringData={"type": "object", "additionalProperties": {"type": "string"}}),
    "PersistentVolumeClaim": _kind("v1", "PersistentVolumeClaim", spec=_obj(
        ["accessModes", "resources"], accessModes={"type": "array", "items": {"enum": ["ReadWriteOnce",
                                                                                       "ReadWriteMany"]}},
        resources=_obj(["requests"], requests=QUANTITIES))),
    "Service": _kind("v1", "Service", spec=_obj(
        ["selector", "ports"], type={"const": "ClusterIP"}, selector=LABELS,
        ports={"type": "array", "minItems": 1, "items": _obj(
            ["port", "targetPort"], name={"type": "string"}, port=PORT, targetPort=PORT, protocol={"enum": ["TCP"]})})),
    "Job": _kind("batch/v1", "Job", spec=_obj(["template"], backoffLimit={"type": "integer", "minimum": 0},
                                              template=TEMPLATE)),
    "Deployment": _kind("apps/v1", "Deployment", spec=_obj(["replicas", "selector", "template"],
                                                           replicas={"type": "integer", "minimum": 1},
                                                           selector=SELECTOR, template=TEMPLATE)),
    "NetworkPolicy": _kind("networking.k8s.io/v1", "NetworkPolicy", spec=_obj(
        ["podSelector", "ingress"], podSelector=SELECTOR, policyTypes={"type": "array", "items": {"const": "Ingress"}},
        ingress={"type": "array", "items": _obj(
            ["from", "ports"], **{"from": {"type": "array", "items": _obj(["podSelector"], podSelector=SELECTOR)}},
            ports={"type": "array", "items": _obj(["port"], port=PORT, protocol={"enum": ["TCP"]})})})),
}


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


@pytest.mark.parametrize(("where", "doc"), DOCS, ids=[f"{w}:{d['kind']}" for w, d in DOCS])
def test_each_document_is_valid_against_the_schema_of_its_kind(where, doc):
    assert doc.get("kind") in SCHEMAS, f"{where}: a kind the test has no schema for: {doc.get('kind')}"
    jsonschema.validate(doc, SCHEMAS[doc["kind"]])


def test_the_worker_reaches_the_master_service_on_its_port(gathered):
    service, job, workers = _one("Service"), _one("Job"), _one("Deployment")
    master, worker = _master_options(gathered), _options(_container(workers))
    assert master.master and master.headless and worker.worker and not worker.master
    assert worker.master_host == service["metadata"]["name"]
    (port,) = service["spec"]["ports"]
    bind_port = master.master_bind_port or DEFAULT_MASTER_PORT
    assert worker.master_port == port["port"] and port["targetPort"] == bind_port
    assert bind_port in [p["containerPort"] for p in _container(job)["ports"]]
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert workers["spec"]["selector"]["matchLabels"] == workers["spec"]["template"]["metadata"]["labels"]
    assert master.expect_workers == workers["spec"]["replicas"]
    policy = _one("NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"][0]["port"] == bind_port
    assert rule["from"][0]["podSelector"]["matchLabels"] == workers["spec"]["template"]["metadata"]["labels"]


def test_the_secret_holds_the_target_and_no_secret_is_on_a_command_line(gathered):
    parser = _parser()
    env_options = {a.env_var: a.dest for a in parser._actions if getattr(a, "env_var", None)}
    secret_options = ("--k3-api-key", "--k3-header", "--host", "-H")
    for workload in (_one("Job"), _one("Deployment")):
        for container in _containers(workload):  # init containers too: nothing secret on a command line
            assert not any(arg.startswith(secret_options) for arg in container.get("args", [])), container["name"]
            assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in container.get("env", [])
                           if container["name"] == "gather"), container["name"]
        container = _container(workload)
        for env in container.get("env", []):
            assert env["name"] in env_options, f"{env['name']}: no option reads it"
            ref = env["valueFrom"]["secretKeyRef"]
            secret = _one("Secret", ref["name"])
            assert ref["key"] in secret["stringData"], ref
    master_env = {e["name"]: env_options[e["name"]] for e in _container(_one("Job"))["env"]}
    assert sorted(master_env.values()) == ["host", "k3_api_key"]
    # the master never relays the key (k3load.loadgen.held_secrets): each worker reads it from the same Secret
    refs = {w: {e["name"]: e["valueFrom"]["secretKeyRef"] for e in _container(_one(w))["env"]}
            for w in ("Job", "Deployment")}
    assert refs["Deployment"]["K3_API_KEY"] == refs["Job"]["K3_API_KEY"]


def test_the_results_volume_holds_the_run_directory_and_the_plan_is_where_both_read_it(gathered):
    job, workers = _one("Job"), _one("Deployment")
    pod = job["spec"]["template"]["spec"]
    master = _master_options(gathered)
    results = _mount_of(_container(job), pod, master.k3_out)
    assert results["persistentVolumeClaim"]["claimName"] == _one("PersistentVolumeClaim")["metadata"]["name"]
    plan_path = PurePosixPath(master.k3_plan)
    for workload in (job, workers):  # a worker loads the plan from the master's --k3-plan path
        volume = _mount_of(_container(workload), workload["spec"]["template"]["spec"], str(plan_path))
        config = _one("ConfigMap", volume["configMap"]["name"])
        assert plan_path.name in config["data"]
    assert pod["restartPolicy"] == "Never" and (ROOT / master.k3_recipe).is_file()


def test_the_plan_in_the_config_map_is_a_valid_plan_with_scenarios_for_its_families(tmp_path):
    (plan_file,) = _one("ConfigMap", "k3load-plan")["data"].items()
    path = tmp_path / plan_file[0]
    path.write_text(plan_file[1])
    opts = argparse.Namespace(k3_scenarios=str(ROOT / "scenarios" / "*.yaml"), k3_plan=str(path))
    scenarios, plan = load_inputs(opts, ROOT / "plans")
    assert plan.stages and plan.families() <= set(scenarios)


def test_the_targets_url_and_key_from_the_secret_stay_out_of_run_json(monkeypatch, gathered):
    """The master's options as the Job gives them (the Secret's values in its environment) go to run.json
    with the key masked and no user:password left in the URL."""
    import json

    from k3load.loadgen.options import public_options

    monkeypatch.setenv("LOCUST_HOST", "https://probe:pw-SECRET@vllm.example.internal:8000")
    monkeypatch.setenv("K3_API_KEY", "sk-SECRET-key")
    options = _master_options(gathered)
    assert options.host.startswith("https://probe:pw-SECRET@") and options.k3_api_key == "sk-SECRET-key"
    written = json.dumps(public_options(options))
    assert "SECRET" not in written and '"host": "https://vllm.example.internal:8000"' in written


# -- the precheck's evidence, gathered in the cluster (issue 26 item 5) ---------------------------------------
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


@pytest.fixture(scope="module")
def gathered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The evidence folder as `gather` leaves it, on two nodes with the same driver."""
    done, evidence = _run_gather(tmp_path_factory.mktemp("gather"))
    assert done.returncode == 0, done.stderr
    return evidence


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The evidence folder as `gather` leaves it, on two nodes at different driver patch levels."""
    done, evidence = _run_gather(tmp_path_factory.mktemp("mixed"), drivers=MIXED_DRIVERS)
    assert done.returncode == 0, done.stderr
    return evidence


def _mount_path(container: dict[str, Any], volume: str) -> str:
    (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume]
    return mount


def _master_options(evidence: Path) -> argparse.Namespace:
    """The master's options with the evidence volume standing at `evidence` (its --config read from there)."""
    master = _container(_one("Job"))
    return _options(master, {_mount_path(master, "evidence"): evidence})


def _precheck(options: argparse.Namespace, out: Path, **override: Any) -> dict[str, dict[str, Any]]:
    """The compat precheck on the master's options (no server): its rules by id."""
    inputs = dict(container_info=options.k3_container_info, startup_log=options.k3_startup_log, image=options.k3_image,
                  host_inventories=[Path(p) for p in options.k3_host_inventory])
    compat = run_precheck(out, ROOT / options.k3_recipe, None, use_local_nvml=options.k3_nvml != "off",
                          **(inputs | override))
    return {r["id"]: r for r in compat["rules"]}


def test_the_kustomization_renders_every_manifest_and_no_k3load_pod_asks_for_a_gpu():
    listed = sorted(KUSTOMIZATION["resources"])
    assert listed == sorted(p.name for p in (EXAMPLE / "manifests").glob("*.yaml") if p.name != "kustomization.yaml")
    job = _one("Job")
    assert [c["name"] for c in job["spec"]["template"]["spec"]["initContainers"]] == ["gather"]
    for workload in (job, _one("Deployment")):  # collect-env runs in the serving pods: no GPU held by k3load
        for container in _containers(workload):
            held = {**container["resources"].get("requests", {}), **container["resources"].get("limits", {})}
            assert "nvidia.com/gpu" not in held, container["name"]
    recipe = yaml.safe_load((ROOT / "recipes" / "kimi-k3.yaml").read_text())
    assert SERVING_IMAGE in recipe["image"]["official"]  # the stand-in Deployment's image: image_official can pass


def test_gather_writes_where_the_master_reads_through_one_volume(gathered):
    job = _one("Job")
    pod = job["spec"]["template"]["spec"]
    master, gather = _container(job), _container(job, "gather")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "evidence"]
    assert "emptyDir" in volume  # shared by `gather` and the master, gone with the pod
    mount = _mount_path(master, "evidence")
    assert _mount_path(gather, "evidence") == mount
    gather_env = {e["name"]: _env_value(e) for e in gather["env"]}
    assert gather_env["EVIDENCE_DIR"] == mount and gather_env["COLLECT_ENV"] == "exec"
    assert master["args"][master["args"].index("--config") + 1] == f"{mount}/k3load.conf"
    assert "--k3-container-info" not in master["args"]  # per node, from k3load.conf only
    conf = (gathered / "k3load.conf").read_text()
    assert f"k3-container-info = [{', '.join(f'{n}={mount}/container/{n}.txt' for n in NODES)}]" in conf.replace(
        str(gathered), mount)
    script = _one("ConfigMap", _volume(pod, gather, "/etc/k3load-evidence")["configMap"]["name"])
    assert gather["command"] == ["sh", "/etc/k3load-evidence/gather.sh"] and "gather.sh" in script["data"]


def _volume(pod: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    (name,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == path]
    return next(v for v in pod["volumes"] if v["name"] == name)


def test_every_precheck_input_reaches_the_master_per_node(gathered, tmp_path):
    master = _container(_one("Job"))
    plan_dir = tmp_path / "plan"  # the plan ConfigMap's files, where the master mounts it
    plan_dir.mkdir()
    for name, text in _one("ConfigMap", "k3load-plan")["data"].items():
        (plan_dir / name).write_text(text)
    options = _options(master, {_mount_path(master, "evidence"): gathered, _mount_path(master, "plan"): plan_dir})
    files = node_files(options)
    assert files["k3_startup_log"].nodes() == files["k3_container_info"].nodes() == list(NODES)
    assert files["k3_startup_log"].paths() == [gathered / "startup" / f"{n}.log" for n in NODES]
    assert files["k3_container_info"].paths() == [gathered / "container" / f"{n}.txt" for n in NODES]
    assert [Path(p) for p in options.k3_host_inventory] == [gathered / "hosts" / f"{n}.json" for n in NODES]
    assert options.k3_image == SERVING_IMAGE  # read from the Deployment by gather.sh
    hosts = [json.loads(Path(p).read_text()) for p in options.k3_host_inventory]
    assert [(h["node"], h["container_image"], h["driver_version"], h["gpu_count"]) for h in hosts] == [
        (n, SERVING_IMAGE, "580.95.05", 4) for n in NODES]
    for node in NODES:  # the whole log and the whole collect-env, as the stand-in cluster gave them
        assert (gathered / "startup" / f"{node}.log").read_text() == STARTUP_LOG.read_text()
        assert (gathered / "container" / f"{node}.txt").read_text() == COLLECT_ENV.read_text()
    # --k3-nvml off only where the inventories stand in for it (else driver and GPU rules fail: rebuild)
    assert options.k3_nvml != "off" or options.k3_host_inventory
    options.k3_recipe, options.k3_scenarios = str(ROOT / options.k3_recipe), str(ROOT / options.k3_scenarios)
    check_inputs(options, ROOT / "plans")  # every option and file as a Locust run checks them before load


def test_the_precheck_on_the_gathered_evidence_passes_every_rule_that_needs_no_server(gathered, tmp_path):
    rules = _precheck(_master_options(gathered), tmp_path / "run")
    server = {"server_reachable", "metrics_reachable", "target_not_sim"}  # no server here: inconclusive
    assert {k: r["status"] for k, r in rules.items() if k not in server} == {
        "vllm_version": "pass", "image_official": "pass", "cuda_build": "pass", "driver_branch": "pass",
        "gpu_count": "pass", "gpu_model": "pass", "node_consistency": "pass", "serve_flags": "pass",
        "startup_log": "pass", "custom_build": "not_applicable"}, rules
    assert "node gb300-n02: no NCCL" in rules["startup_log"]["reason"]
    assert "2 node(s)" in rules["node_consistency"]["reason"]
    assert all(n in rules["cuda_build"]["reason"] for n in NODES), rules["cuda_build"]["reason"]


def test_each_nodes_collect_env_is_judged_against_its_own_host(mixed, tmp_path):
    """Two driver patch levels in one cluster: each pod's collect-env carries its own node's driver and is
    checked against that node's inventory, so driver_branch passes on both; the one collect-env the old
    wiring took from whichever node was free stands for another host and fails it."""
    options = _master_options(mixed)
    files = node_files(options)["k3_container_info"]
    assert files.nodes() == list(NODES)
    for node, path in zip(files.nodes(), files.paths(), strict=True):
        assert path == mixed / "container" / f"{node}.txt"
        rows = [line for line in path.read_text().splitlines() if line.startswith("Nvidia driver version")]
        assert rows == [f"Nvidia driver version        : {MIXED_DRIVERS[node]}"]
    hosts = {h["node"]: h["driver_version"] for h in map(json.loads, (Path(p).read_text()
                                                                       for p in options.k3_host_inventory))}
    assert hosts == MIXED_DRIVERS
    rules = _precheck(options, tmp_path / "run")
    assert rules["driver_branch"]["status"] == "pass", rules["driver_branch"]
    assert rules["driver_branch"]["reason"] == "R580+ on every node: gb300-n01 580.95.05, gb300-n02 580.105.08"
    assert rules["cuda_build"]["status"] == "pass", rules["cuda_build"]
    # the precheck's own judgement of the cluster, not of the example: the nodes' drivers differ
    assert rules["node_consistency"]["status"] == "fail"
    assert "nodes differ in driver: gb300-n01 580.95.05, gb300-n02 580.105.08" in rules["node_consistency"]["reason"]
    # the old wiring: one collect-env, bare, from the GPU node the init container landed on (a free one, here
    # outside the serving pool, at another patch level) for the whole cluster
    free_node = tmp_path / "collect-env.txt"
    free_node.write_text(COLLECT_ENV.read_text().replace(": 580.95.05", ": 580.82.07"))
    old = _precheck(options, tmp_path / "old", container_info=str(free_node))
    assert old["driver_branch"]["status"] == "fail"
    assert old["driver_branch"]["reason"] == (
        "collect-env saw driver 580.82.07 inside the container, the hosts report 580.105.08, 580.95.05: the "
        "container info is from another host")


def test_gather_stops_when_a_pods_start_up_lines_were_rotated_away(tmp_path):
    done, evidence = _run_gather(tmp_path, rotated=("vllm-1",))
    assert done.returncode == 1 and not (evidence / "k3load.conf").exists()
    said = [line for line in done.stderr.splitlines() if line.startswith("k3load gather:")]
    assert said == [done.stderr.splitlines()[-1]] == [  # the stop, in one line, after vllm-0's inventory line
        "k3load gather: pod vllm-1 (node gb300-n02): the start-up lines were rotated away (no vLLM 'non-default "
        "args:' line in its log): restart the pod before the acceptance, or keep its log from start"]
    assert not any(c[0] == "exec" and "vllm-1" in c for c in _calls(tmp_path))  # stopped before its collect-env
    rotated = (evidence / "startup" / "gb300-n02.log").read_text()  # what the stand-in served: no start-up lines
    assert rotated and "non-default args: " not in rotated


def test_gather_stops_naming_the_pod_when_collect_env_cannot_run(tmp_path):
    done, evidence = _run_gather(tmp_path, exec_forbidden=True)
    assert done.returncode == 1 and not (evidence / "k3load.conf").exists()
    assert done.stderr.splitlines()[-1] == (
        "k3load gather: pod vllm-0 (node gb300-n01): collect-env failed in container vllm (where exec is not "
        "allowed: COLLECT_ENV=off, and give each node's by hand, README.md)")


def test_gather_without_exec_writes_no_container_info(tmp_path):
    """COLLECT_ENV=off, where exec is not allowed: no exec call, no k3-container-info (given by hand)."""
    done, evidence = _run_gather(tmp_path, exec_forbidden=True, COLLECT_ENV="off")
    assert done.returncode == 0, done.stderr
    assert not any(c[0] == "exec" for c in _calls(tmp_path))
    conf = (evidence / "k3load.conf").read_text()
    assert "k3-container-info" not in conf and "k3-startup-log = [gb300-n01=" in conf
    assert not list((evidence / "container").iterdir())


def _bindings(account: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(role, rule) of every rule bound to the ServiceAccount `account`."""
    return [(role, rule) for binding in RENDERED if binding["kind"] in ("RoleBinding", "ClusterRoleBinding")
            if any(s["name"] == account for s in binding["subjects"])
            for role in [_one(binding["roleRef"]["kind"], binding["roleRef"]["name"])] for rule in role["rules"]]


def test_the_evidence_token_does_only_what_gather_calls_and_only_in_gather(tmp_path):
    done, _ = _run_gather(tmp_path)
    assert done.returncode == 0, done.stderr
    calls = _calls(tmp_path)
    pod = _one("Job")["spec"]["template"]["spec"]
    account = _one("ServiceAccount", pod["serviceAccountName"])
    rules = _bindings(account["metadata"]["name"])
    gather_env = {e["name"]: _env_value(e) for e in _container(_one("Job"), "gather")["env"]}
    for call in calls:  # each kubectl call gather.sh made is one the bound roles allow
        for verb, resource, name in _rbac_of(call):
            assert any(resource in rule["resources"] and verb in rule["verbs"]
                       and (not rule.get("resourceNames") or name in rule["resourceNames"])
                       for _, rule in rules), (verb, resource, name, call)
    assert ["get", "deployment", "-n", "default", gather_env["SERVING_DEPLOYMENT"]] == calls[0][:5]
    assert {c[0] if c[0] in ("logs", "exec") else c[1] for c in calls} == {
        "deployment", "pod", "pods", "logs", "node", "exec"}
    # exec: into the serving pods only, their serving container, collect-env only; the CLI first, then the module
    execs = [(c[c.index("exec") + 3], c[c.index("-c") + 1], c[c.index("--") + 1:]) for c in calls if c[0] == "exec"]
    cli, module = ["vllm", "collect-env"], ["python3", "-m", "vllm.collect_env"]
    assert execs == [("vllm-0", "vllm", cli), ("vllm-1", "vllm", cli), ("vllm-1", "vllm", module)]
    assert {c[c.index("-n") + 1] for c in calls if "-n" in c} == {KUSTOMIZATION["namespace"]}
    # the only write: pods/exec, in a namespaced Role (the serving namespace), never cluster-wide
    writes = [(role["kind"], rule["resources"]) for role, rule in rules if set(rule["verbs"]) - {"get", "list"}]
    assert writes == [("Role", ["pods/exec"])]
    # the token is mounted in gather alone: the master and the workers hold no Kubernetes credential
    assert pod["automountServiceAccountToken"] is False and account["automountServiceAccountToken"] is False
    token_path = "/var/run/secrets/kubernetes.io/serviceaccount"
    holders = [c["name"] for c in _containers(_one("Job")) + _containers(_one("Deployment"))
               if any(m["mountPath"] == token_path for m in c.get("volumeMounts", []))]
    assert holders == ["gather"]


def _rbac_of(call: list[str]) -> list[tuple[str, str, str | None]]:
    """(verb, resource, name) of each permission the API server checks for one kubectl call. exec: `get`
    (the WebSocket upgrade kubectl 1.30+ sends) and `create` (the SPDY POST; and checked on WebSocket too
    from 1.35, AuthorizePodWebsocketUpgradeCreatePermission)."""
    words, skip = [], False
    for arg in call[:call.index("--")] if "--" in call else call:
        if not skip and arg in ("-n", "-o", "-l", "-c"):
            skip = True
        elif not skip and not arg.startswith("-"):
            words.append(arg)
        else:
            skip = False
    if words[0] == "exec":
        return [("get", "pods/exec", words[1]), ("create", "pods/exec", words[1])]
    if words[0] == "logs":
        return [("get", "pods/log", words[1])]
    if words[1] == "pods":
        return [("list", "pods", None)]
    return [("get", {"deployment": "deployments", "pod": "pods", "node": "nodes"}[words[1]], words[2])]
