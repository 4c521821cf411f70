"""The Kubernetes example's consistency on the rendered manifests, with the master's options read through the
evidence volume as `gather` leaves it (issue 26 item 5): the worker reaches the master's Service and port, every
option on a container's command line is one the real Locust + k3load parser accepts, the Secret and its keys
exist and stay out of run.json, the results volume holds --k3-out; the files gather.sh writes are the files the
master's options name (through the same volume, mounted in both), each node's collect-env reaches its NODE=PATH
and is judged against its own host, and the precheck judged on what it wrote passes every rule that needs no
server.

gather.sh runs once per module for each cluster (`gathered`: one driver; `mixed`: two patch levels), against
the stand-in kubectl of tests/sim/k8s_manifests.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from k3load.loadgen.inputs import check_inputs, node_files
from k3load.precheck import run_precheck
from tests.sim.k8s_manifests import (
    COLLECT_ENV,
    DEFAULT_MASTER_PORT,
    MIXED_DRIVERS,
    NODES,
    ROOT,
    SERVING_IMAGE,
    STARTUP_LOG,
    _container,
    _containers,
    _env_value,
    _master_options,
    _mount_of,
    _mount_path,
    _one,
    _options,
    _parser,
    _run_gather,
)


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


def _precheck(options: argparse.Namespace, out: Path, **override: Any) -> dict[str, dict[str, Any]]:
    """The compat precheck on the master's options (no server): its rules by id."""
    inputs = dict(container_info=options.k3_container_info, startup_log=options.k3_startup_log, image=options.k3_image,
                  host_inventories=[Path(p) for p in options.k3_host_inventory])
    compat = run_precheck(out, ROOT / options.k3_recipe, None, use_local_nvml=options.k3_nvml != "off",
                          **(inputs | override))
    return {r["id"]: r for r in compat["rules"]}


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
