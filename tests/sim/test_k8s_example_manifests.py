"""The Kubernetes example under docs/kubernetes/: every YAML document valid against a schema of the fields it
uses (unknown keys rejected, so a typo fails here and not on a cluster), the kustomization renders every
manifest and no k3load pod asks for a GPU, and the plan in the ConfigMap is a valid plan whose families have
scenarios."""

from __future__ import annotations

import argparse
from typing import Any

import jsonschema
import pytest
import yaml

from k3load.loadgen.inputs import load_inputs
from tests.sim.k8s_manifests import DOCS, EXAMPLE, KUSTOMIZATION, ROOT, SERVING_IMAGE, _containers, _one

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


@pytest.mark.parametrize(("where", "doc"), DOCS, ids=[f"{w}:{d['kind']}" for w, d in DOCS])
def test_each_document_is_valid_against_the_schema_of_its_kind(where, doc):
    assert doc.get("kind") in SCHEMAS, f"{where}: a kind the test has no schema for: {doc.get('kind')}"
    jsonschema.validate(doc, SCHEMAS[doc["kind"]])


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


def test_the_plan_in_the_config_map_is_a_valid_plan_with_scenarios_for_its_families(tmp_path):
    (plan_file,) = _one("ConfigMap", "k3load-plan")["data"].items()
    path = tmp_path / plan_file[0]
    path.write_text(plan_file[1])
    opts = argparse.Namespace(k3_scenarios=str(ROOT / "scenarios" / "*.yaml"), k3_plan=str(path))
    scenarios, plan = load_inputs(opts, ROOT / "plans")
    assert plan.stages and plan.families() <= set(scenarios)
