"""The Kubernetes example under docs/kubernetes/: every YAML document valid against a schema of the fields it
uses (unknown keys rejected, so a typo fails here and not on a cluster), and the consistency a running
example depends on: the worker reaches the master's Service and port, every option on a container's
command line is one the real Locust + k3load parser accepts, the Secret and its keys exist, the results
volume holds --k3-out, and the plan in the ConfigMap is a valid plan whose families have scenarios."""

from __future__ import annotations

import argparse
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import yaml

from k3load.loadgen.inputs import load_inputs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "kubernetes"
DEFAULT_MASTER_PORT = 5557  # Locust's --master-port / --master-bind-port default

NAME = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
STRINGS = {"type": "array", "items": {"type": "string"}}
QUANTITIES = {"type": "object", "propertyNames": {"enum": ["cpu", "memory", "storage"]},
              "additionalProperties": {"type": "string"}}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}


def _obj(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties, "additionalProperties": False}


METADATA = _obj(["name"], name=NAME, labels=LABELS)
SELECTOR = _obj(["matchLabels"], matchLabels=LABELS)
KEY_REF = _obj(["name", "key"], name=NAME, key={"type": "string"})
ENV = _obj(["name"], name={"type": "string", "pattern": "^[A-Z_][A-Z0-9_]*$"}, value={"type": "string"},
           valueFrom=_obj(["secretKeyRef"], secretKeyRef=KEY_REF))
CONTAINER = _obj(
    ["name", "image", "command", "args"], name=NAME, image={"type": "string"}, command=STRINGS, args=STRINGS,
    env={"type": "array", "items": ENV},
    ports={"type": "array", "items": _obj(["containerPort"], name={"type": "string"}, containerPort=PORT,
                                          protocol={"enum": ["TCP"]})},
    volumeMounts={"type": "array", "items": _obj(["name", "mountPath"], name=NAME, mountPath={"type": "string"},
                                                 readOnly={"type": "boolean"})},
    resources=_obj([], requests=QUANTITIES, limits=QUANTITIES))
VOLUME = _obj(["name"], name=NAME, configMap=_obj(["name"], name=NAME),
              persistentVolumeClaim=_obj(["claimName"], claimName=NAME))
POD_SPEC = _obj(["containers"], containers={"type": "array", "minItems": 1, "items": CONTAINER},
                volumes={"type": "array", "items": VOLUME}, restartPolicy={"enum": ["Always", "Never", "OnFailure"]},
                terminationGracePeriodSeconds={"type": "integer", "minimum": 0},
                securityContext=_obj([], runAsNonRoot={"type": "boolean"}, runAsUser={"type": "integer"},
                                     fsGroup={"type": "integer"}))
TEMPLATE = _obj(["metadata", "spec"], metadata=_obj([], labels=LABELS), spec=POD_SPEC)


def _kind(api_version: str, kind: str, **properties: Any) -> dict[str, Any]:
    return _obj(["apiVersion", "kind", "metadata", *properties], apiVersion={"const": api_version},
                kind={"const": kind}, metadata=METADATA, **properties)


SCHEMAS = {
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


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in DOCS if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _parser() -> Any:
    from locust.argument_parser import get_parser

    from k3load.loadgen.options import add_options

    parser = get_parser(default_config_files=[])
    add_options(parser)
    return parser


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _options(container: dict[str, Any]) -> argparse.Namespace:
    """The container's command line through the real parser (an unknown option exits: a failure here)."""
    command, args = container["command"], container["args"]
    assert command[:2] == ["locust", "-f"] and (ROOT / command[2]).is_file(), command
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


def test_the_worker_reaches_the_master_service_on_its_port():
    service, job, workers = _one("Service"), _one("Job"), _one("Deployment")
    master, worker = _options(_container(job)), _options(_container(workers))
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


def test_the_secret_holds_the_target_and_no_secret_is_on_a_command_line():
    parser = _parser()
    env_options = {a.env_var: a.dest for a in parser._actions if getattr(a, "env_var", None)}
    for workload in (_one("Job"), _one("Deployment")):
        container = _container(workload)
        assert not any(arg.startswith(("--k3-api-key", "--k3-header", "--host", "-H")) for arg in container["args"])
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


def test_the_results_volume_holds_the_run_directory_and_the_plan_is_where_both_read_it():
    job, workers = _one("Job"), _one("Deployment")
    pod = job["spec"]["template"]["spec"]
    master = _options(_container(job))
    results = _mount_of(_container(job), pod, master.k3_out)
    assert results["persistentVolumeClaim"]["claimName"] == _one("PersistentVolumeClaim")["metadata"]["name"]
    plan_path = PurePosixPath(master.k3_plan)
    for workload in (job, workers):  # a worker loads the plan from the master's --k3-plan path
        volume = _mount_of(_container(workload), workload["spec"]["template"]["spec"], str(plan_path))
        config = _one("ConfigMap", volume["configMap"]["name"])
        assert plan_path.name in config["data"]
    assert pod["restartPolicy"] == "Never" and (ROOT / master.k3_recipe).is_file()


def test_the_plan_in_the_config_map_is_a_valid_plan_with_scenarios_for_its_families(tmp_path):
    (plan_file,) = _one("ConfigMap")["data"].items()
    path = tmp_path / plan_file[0]
    path.write_text(plan_file[1])
    opts = argparse.Namespace(k3_scenarios=str(ROOT / "scenarios" / "*.yaml"), k3_plan=str(path))
    scenarios, plan = load_inputs(opts, ROOT / "plans")
    assert plan.stages and plan.families() <= set(scenarios)


def test_the_targets_url_and_key_from_the_secret_stay_out_of_run_json(monkeypatch):
    """The master's options as the Job gives them (the Secret's values in its environment) go to run.json
    with the key masked and no user:password left in the URL."""
    import json

    from k3load.loadgen.options import public_options

    monkeypatch.setenv("LOCUST_HOST", "https://probe:pw-SECRET@vllm.example.internal:8000")
    monkeypatch.setenv("K3_API_KEY", "sk-SECRET-key")
    options = _options(_container(_one("Job")))
    assert options.host.startswith("https://probe:pw-SECRET@") and options.k3_api_key == "sk-SECRET-key"
    written = json.dumps(public_options(options))
    assert "SECRET" not in written and '"host": "https://vllm.example.internal:8000"' in written
