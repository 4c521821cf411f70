"""gather.sh, the Kubernetes example's `gather` init container (issue 26 item 5), on its own against a stand-in
kubectl: a pod whose start-up lines were rotated away stops it with one line, so does a pod where collect-env
cannot run, COLLECT_ENV=off writes no container info, and every kubectl call it makes is one its roles allow
(the evidence token held by `gather` alone)."""

from __future__ import annotations

from typing import Any

from tests.sim.k8s_manifests import (
    KUSTOMIZATION,
    RENDERED,
    _calls,
    _container,
    _containers,
    _env_value,
    _one,
    _run_gather,
)


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
