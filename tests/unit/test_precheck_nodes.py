"""Per-node evidence (issue 26 item 4): --startup-log / --container-info as NODE=PATH, gathered per node
under DIR/evidence and judged per node; the bare path keeps its single-node paths and reasons.

The NODE=PATH parser reads outside bytes (a command line, an env var, a config file), so it gets
property tests: whatever the text, it returns entries or raises NodeFilesError naming the option, and
entries written out and read back are the same entries."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3load.loadgen.inputs import HarnessError, check_options, node_files
from k3load.precheck import PrecheckError, recheck, run_precheck
from k3load.precheck.cli import main as precheck_main
from k3load.precheck.node_files import NodeFile, NodeFilesError, parse_node_files

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "precheck"
KIMI = ROOT / "recipes" / "kimi-k3.yaml"
K3_IMAGE = "vllm/vllm-openai:kimi-k3"
HOSTS = [DATA / "hosts" / "gb300-n01.json", DATA / "hosts" / "gb300-n02.json"]
GOOD_ENV, CU128_ENV = DATA / "collect-env" / "cu130-gb300.txt", DATA / "collect-env" / "cu128-gb300.txt"
CLEAN_LOG, NCCL_LOG = DATA / "logs" / "k3-clean.log", DATA / "logs" / "k3-nccl-warning.log"


# -- the NODE=PATH parser ------------------------------------------------------------------------------------
NODES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
PATHS = st.from_regex(r"/[A-Za-z0-9._/-]{1,30}", fullmatch=True)


@given(st.dictionaries(NODES, PATHS, min_size=1, max_size=6), st.sampled_from(["\n", ",", "\r\n", " , "]))
def test_entries_written_out_read_back_the_same(entries: dict[str, str], sep: str) -> None:
    text = sep.join(f"{node}={path}" for node, path in entries.items())
    parsed = parse_node_files(text, "--k3-startup-log")
    assert parsed.entries == tuple(NodeFile(n, Path(p)) for n, p in entries.items())
    assert parsed.named and parsed.nodes() == list(entries)


@given(st.lists(st.text(max_size=40), max_size=4))
@settings(max_examples=300)
def test_any_text_gives_entries_or_one_line_naming_the_option(values: list[str]) -> None:
    try:
        parsed = parse_node_files(values, "--k3-container-info")
    except NodeFilesError as exc:
        assert str(exc).startswith("--k3-container-info") and "\n" not in str(exc)
        return
    nodes = [e.node for e in parsed.entries]
    assert len(nodes) == len(set(nodes))  # never a node twice
    assert all(str(e.path).strip() for e in parsed.entries)  # never an empty path
    assert None not in nodes or len(nodes) == 1  # a bare path only alone


@given(PATHS)
def test_a_bare_path_is_one_unnamed_node(path: str) -> None:
    parsed = parse_node_files(path, "--startup-log")
    assert parsed.entries == (NodeFile(None, Path(path)),) and not parsed.named


@pytest.mark.parametrize(("text", "words"), [
    ("=/a.log", "empty node name"),
    ("n01=/a.log\nn01=/b.log", "node n01 given twice"),
    ("n01=", "path missing for node n01"),
    ("n01=/a.log\n/b.log", "a bare path beside NODE=PATH entries"),
    ("n 1=/a.log", "not a node name"),
])
def test_malformed_entries_are_named(text: str, words: str) -> None:
    with pytest.raises(NodeFilesError, match=words):
        parse_node_files(text, "--k3-startup-log")


def test_a_comma_splits_only_named_entries_and_a_path_with_equals_after_a_slash_is_bare() -> None:
    assert parse_node_files("/logs/a,b.log", "x").entries == (NodeFile(None, Path("/logs/a,b.log")),)
    assert parse_node_files("/runs/run=1/vllm.log", "x").entries == (NodeFile(None, Path("/runs/run=1/vllm.log")),)
    assert parse_node_files(["n01=/a", "n02=/b, n03=/c"], "x").nodes() == ["n01", "n02", "n03"]
    assert not parse_node_files("", "x") and not parse_node_files(None, "x")


# -- judged per node ------------------------------------------------------------------------------------------
def _judge(out: Path, *, logs: dict[str, Path] | Path | None, envs: dict[str, Path] | Path | None,
           hosts: list[Path] = HOSTS) -> dict[str, dict[str, Any]]:
    def spec(given: dict[str, Path] | Path | None) -> Any:
        return [f"{n}={p}" for n, p in given.items()] if isinstance(given, dict) else given
    compat = run_precheck(out, KIMI, None, container_info=spec(envs), host_inventories=hosts,
                          startup_log=spec(logs), image=K3_IMAGE, use_local_nvml=False)
    return {r["id"]: r for r in compat["rules"]}


def test_each_nodes_files_land_on_their_own_paths_and_pass(tmp_path: Path) -> None:
    out = tmp_path / "run"
    rules = _judge(out, logs={"gb300-n01": CLEAN_LOG, "gb300-n02": CLEAN_LOG},
                   envs={"gb300-n01": GOOD_ENV, "gb300-n02": GOOD_ENV})
    ev = out / "evidence"
    assert (ev / "startup" / "gb300-n02.log").read_bytes() == CLEAN_LOG.read_bytes()
    assert (ev / "container" / "gb300-n01" / "collect-env.txt").read_bytes() == GOOD_ENV.read_bytes()
    assert not (ev / "startup.log").exists() and not (ev / "container" / "collect-env.txt").exists()
    for rule in ("cuda_build", "startup_log", "node_consistency", "driver_branch", "vllm_version"):
        assert rules[rule]["status"] == "pass", (rule, rules[rule]["reason"])
    assert "node gb300-n01: CUDA 13.0 build" in rules["cuda_build"]["reason"]
    assert "node gb300-n02: no NCCL, communication or kernel warnings" in rules["startup_log"]["reason"]
    assert "vLLM 0.27.1 and CUDA 13.0 build on gb300-n01, gb300-n02" in rules["node_consistency"]["reason"]
    assert "collect-env gb300-n01, collect-env gb300-n02, startup log gb300-n01" in rules["vllm_version"]["reason"]
    assert "startup/gb300-n02.log" in rules["startup_log"]["evidence"]
    nodes = rules["node_consistency"]["details"]["nodes"]
    assert nodes["gb300-n02"] == {"driver": "580.95.05", "image": K3_IMAGE,
                                  "collect_env": "container/gb300-n02/collect-env.txt",
                                  "startup_log": "startup/gb300-n02.log"}
    assert {r["id"]: r for r in recheck(out)["rules"]} == rules  # read back from the evidence alone


def test_a_node_on_another_cuda_build_fails_naming_it(tmp_path: Path) -> None:
    rules = _judge(tmp_path / "run", logs=None, envs={"gb300-n01": GOOD_ENV, "gb300-n02": CU128_ENV})
    assert rules["cuda_build"]["status"] == "fail"
    assert rules["cuda_build"]["reason"].startswith("node gb300-n02: container built with CUDA 12.8")
    assert "gb300-n01" not in rules["cuda_build"]["reason"]
    consistency = rules["node_consistency"]
    assert consistency["status"] == "fail"
    assert "nodes differ in CUDA build (collect-env): 12.8 on gb300-n02; 13.0 on gb300-n01" in consistency["reason"]


def test_a_node_on_another_vllm_fails_node_consistency_naming_it(tmp_path: Path) -> None:
    other = tmp_path / "n02-env.txt"
    other.write_text(GOOD_ENV.read_text().replace("vLLM Version                 : 0.27.1",
                                                  "vLLM Version                 : 0.27.0"))
    rules = _judge(tmp_path / "run", logs=None, envs={"gb300-n01": GOOD_ENV, "gb300-n02": other})
    assert rules["node_consistency"]["status"] == "fail"
    assert "nodes differ in vLLM version (collect-env): 0.27.0 on gb300-n02; 0.27.1 on gb300-n01" in \
        rules["node_consistency"]["reason"]
    version = rules["vllm_version"]
    assert version["status"] == "fail" and "collect-env gb300-n02 0.27.0" in version["reason"]


def test_one_nodes_nccl_warning_fails_startup_log_naming_that_node(tmp_path: Path) -> None:
    rules = _judge(tmp_path / "run", logs={"gb300-n01": CLEAN_LOG, "gb300-n02": NCCL_LOG}, envs=GOOD_ENV)
    log = rules["startup_log"]
    assert log["status"] == "fail"
    assert log["reason"].startswith("node gb300-n02: 2 NCCL/communication/kernel warning(s)")
    assert "node gb300-n01" not in log["reason"]  # (the log itself quotes its host's name)
    assert log["details"]["nodes"]["gb300-n02"]["flagged"] and not log["details"]["nodes"]["gb300-n01"]["flagged"]


def test_an_inventoried_node_without_its_files_is_named_inconclusive_never_passed(tmp_path: Path) -> None:
    rules = _judge(tmp_path / "run", logs={"gb300-n01": CLEAN_LOG}, envs={"gb300-n01": GOOD_ENV})
    for rule in ("startup_log", "cuda_build", "node_consistency"):
        assert rules[rule]["status"] == "inconclusive", (rule, rules[rule]["reason"])
    assert rules["startup_log"]["reason"].startswith("node gb300-n02: no startup log given")
    assert rules["cuda_build"]["reason"].startswith("node gb300-n02: no collect-env given")
    assert "node gb300-n02: no startup log given" in rules["node_consistency"]["reason"]
    assert "node gb300-n02: no collect-env given" in rules["node_consistency"]["reason"]


def test_the_bare_form_keeps_its_paths_and_reasons(tmp_path: Path) -> None:
    out = tmp_path / "run"
    rules = _judge(out, logs=CLEAN_LOG, envs=GOOD_ENV)
    assert (out / "evidence" / "startup.log").is_file()
    assert (out / "evidence" / "container" / "collect-env.txt").is_file()
    assert rules["startup_log"]["status"] == "pass" and rules["startup_log"]["reason"].startswith("no NCCL")
    assert rules["cuda_build"]["reason"].startswith("CUDA 13.0 build") and "node" not in rules["cuda_build"]["reason"]
    assert rules["node_consistency"]["status"] == "pass"


def test_a_node_no_inventory_names_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(PrecheckError, match="--startup-log: node n03 is in no host inventory"):
        _judge(tmp_path / "run", logs={"n03": CLEAN_LOG}, envs=None)
    assert not (tmp_path / "run" / "evidence").exists()


def test_the_cli_says_a_malformed_entry_in_one_line_and_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                                ) -> None:
    code = precheck_main(["--recipe", str(KIMI), "--out", str(tmp_path / "run"), "--no-nvml",
                          "--startup-log", f"gb300-n01={CLEAN_LOG}", "--startup-log", f"gb300-n01={NCCL_LOG}"])
    err = capsys.readouterr().err.strip()
    assert code == 3 and err == "k3load precheck: --startup-log: node gb300-n01 given twice: one file per node"


def test_the_cli_judges_repeated_node_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--recipe", str(KIMI), "--out", str(tmp_path / "run"), "--no-nvml", "--image", K3_IMAGE]
    args += [a for h in HOSTS for a in ("--host-inventory", str(h))]
    args += ["--startup-log", f"gb300-n01={CLEAN_LOG}", "--startup-log", f"gb300-n02={NCCL_LOG}"]
    assert precheck_main(args) == 1
    compat = json.loads((tmp_path / "run" / "compat.json").read_text())
    (log,) = [r for r in compat["rules"] if r["id"] == "startup_log"]
    assert log["status"] == "fail" and log["reason"].startswith("node gb300-n02:")


# -- a Locust run's options: a harness error before load -----------------------------------------------------
def _opts(**given: Any) -> SimpleNamespace:
    base = dict(k3_sample_interval=1.0, k3_scrape_timeout=0.0, k3_max_restarts=0, k3_out="runs/x",
                k3_recipe=str(KIMI), k3_api_key="", k3_header=[], k3_ca_bundle="", k3_insecure=False,
                k3_custom_build="", k3_host_inventory=[str(h) for h in HOSTS], k3_container_info="",
                k3_startup_log="")
    return SimpleNamespace(**{**base, **given})


@pytest.mark.parametrize(("value", "said"), [
    ("gb300-n01=/a\ngb300-n01=/b", "--k3-startup-log: node gb300-n01 given twice"),
    ("=/a", "--k3-startup-log '=/a': empty node name"),
    ("gb300-n01=", "--k3-startup-log 'gb300-n01=': path missing for node gb300-n01"),
    ("gb300-n01=/no/such.log", "--k3-startup-log gb300-n01=/no/such.log: no such file"),
])
def test_a_malformed_option_is_a_harness_error_naming_it(value: str, said: str) -> None:
    with pytest.raises(HarnessError) as exc:
        check_options(_opts(k3_startup_log=value))
    assert str(exc.value).startswith(said)


def test_the_options_parse_per_node_and_a_bare_path_stays_one_node() -> None:
    files = node_files(_opts(k3_container_info=f"gb300-n01={GOOD_ENV},gb300-n02={CU128_ENV}",
                             k3_startup_log=str(CLEAN_LOG)))
    assert files["k3_container_info"].nodes() == ["gb300-n01", "gb300-n02"]
    assert files["k3_startup_log"].entries == (NodeFile(None, CLEAN_LOG),)
    check_options(_opts(k3_container_info=f"gb300-n01={GOOD_ENV}\ngb300-n02={CU128_ENV}"))  # no error


def test_the_locust_option_is_repeatable_and_read_from_its_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    from locust.argument_parser import get_parser

    from k3load.loadgen.options import add_options

    parser = get_parser(default_config_files=[])
    add_options(parser)
    parsed = parser.parse_args(["-f", "x.py", "--k3-startup-log", "n01=/a", "--k3-startup-log", "n02=/b"])
    assert parse_node_files(parsed.k3_startup_log, "x").nodes() == ["n01", "n02"]
    monkeypatch.setenv("K3_CONTAINER_INFO", "n01=/a.txt\nn02=/b.txt")
    parsed = parser.parse_args(["-f", "x.py"])
    assert parse_node_files(parsed.k3_container_info, "x").paths() == [Path("/a.txt"), Path("/b.txt")]


def test_the_checklist_node_line_names_every_node(tmp_path: Path) -> None:
    from k3load.analysis.decision.checklist import node_item

    out = tmp_path / "run"
    shutil.rmtree(out, ignore_errors=True)
    run_precheck(out, KIMI, None, host_inventories=HOSTS, startup_log=[f"gb300-n01={CLEAN_LOG}"], image=K3_IMAGE,
                 use_local_nvml=False)
    compat = json.loads((out / "compat.json").read_text())
    item = node_item(SimpleNamespace(compat=compat))
    assert item["status"] == "open"
    assert "gb300-n01 (driver 580.95.05, vllm/vllm-openai:kimi-k3, startup log)" in item["detail"]
    assert "gb300-n02 (driver 580.95.05, vllm/vllm-openai:kimi-k3, no startup log)" in item["detail"]


def test_the_option_text_as_a_locust_run_hands_it_over_is_read_per_node(tmp_path: Path) -> None:
    """k3load.loadgen.observe passes the option's value as Path(text): the entries survive it."""
    text = f"gb300-n01={CLEAN_LOG}\ngb300-n02={NCCL_LOG}"
    compat = run_precheck(tmp_path / "run", KIMI, None, host_inventories=HOSTS, startup_log=Path(text),
                          container_info=Path(str(GOOD_ENV)), image=K3_IMAGE, use_local_nvml=False)
    (log,) = [r for r in compat["rules"] if r["id"] == "startup_log"]
    assert log["evidence"] == ["startup/gb300-n01.log", "startup/gb300-n02.log"] and log["status"] == "fail"
