"""Harness errors end to end: a bad input stops the run before any load, with exit code 2 and one line.

Each case runs the real command (`locust -f locustfiles/agent.py --headless ...` against one sim shared
by the module, or a `k3load` subcommand) and asserts: the documented exit code, no traceback, exactly
one error line (the option, or FILE:LINE:COLUMN and the field), said once, no run directory, and a sim
that served no chat request. The commands run four at a time to keep the module near 30 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import yaml

from k3load.loadgen import observe
from k3load.loadgen.inputs import HarnessError, check_options, plan_path, scenario_paths
from k3load.loadgen.options import session_header
from k3load.loadgen.target import TargetApi
from k3load.precheck.recipe import RecipeError
from k3load.sim.process import SimProcess
from k3load.yamlfile import YamlFileError, load_yaml_text
from tests.conftest import FAST_SIM
from tests.probes import Target, scrape, total

ROOT = Path(__file__).resolve().parents[2]
LOCUST_INFO = "/INFO/"  # Locust's own log lines ("Starting Locust 2.47.0", "exit code 2"): not errors
BROKEN_MAPPING = "name: broken\nfamily: agent\n  oops: [\n"  # line 3, column 7: "mapping values ..."
BROKEN_RECIPE = "format: 1\nname: local-dev\n  production: false\n"  # line 3, column 13
TINY_PLAN = {"name": "tiny", "stages": [{"name": "load", "kind": "load", "duration_s": 3, "users": 1,
                                         "mix": {"agent": 1}}]}


@dataclass
class Case:
    """A command, the exit code it must end with and the one line it must print on stderr."""

    argv: list[str]
    exit_code: int
    line: str
    run_dir: Path | None = None  # a Locust run: its --k3-out must never be created


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _locust(url: str, d: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(ROOT / "locustfiles" / "agent.py"), "--headless",
            "--only-summary", "--host", url, "--k3-out", str(d / "out"), "--k3-plan", str(d / "plan.yaml"),
            "--k3-recipe", "recipes/local-dev.yaml", *extra]


def _processes() -> list[str]:
    """--processes 2 on a free master port: the master stops its forked workers, none is left behind."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    return ["--processes", "2", "--master-bind-port", port, "--master-port", port]


def _k3load(*args: str) -> list[str]:
    return [sys.executable, "-m", "k3load", *args]


def _recipe_with(d: Path, extra: str) -> Path:
    return _write(d / "recipe.yaml", (ROOT / "recipes" / "local-dev.yaml").read_text() + extra)


def _locust_cases(url: str, d: dict[str, Path]) -> dict[str, Case]:
    """`locust -f locustfiles/agent.py` with one bad input each; its --k3-out must never be created."""
    scen = _write(d["scenario_yaml"] / "scen" / "broken.yaml", BROKEN_MAPPING)
    plan = _write(d["plan_yaml"] / "plan.yaml", "name: tiny\nstages:\n  - {name: load, kind: load\n")
    recipe_yaml = _write(d["recipe_yaml"] / "recipe.yaml", BROKEN_RECIPE)
    recipe_key = _recipe_with(d["recipe_unknown_key"], "colour: blue\n")
    no_scen = str(d["scenarios_none"] / "none" / "*.yaml")
    said = "k3load: harness error: "
    cases = {
        "scenario_yaml": (["--k3-scenarios", str(scen)],
                          f"{scen}:3:7: YAML error: mapping values are not allowed here"),
        "plan_yaml": ([], f"{plan}:4:1: YAML error: expected ',' or '}}', but got '<stream end>' (while parsing a "
                      "flow mapping started at 3:5)"),
        "recipe_yaml": (["--k3-recipe", str(recipe_yaml)],
                        f"{recipe_yaml}:3:13: YAML error: mapping values are not allowed here"),
        "recipe_unknown_key": (["--k3-recipe", str(recipe_key)],
                               f"{recipe_key}: (top level): Additional properties are not allowed ('colour' was "
                               "unexpected)"),
        "recipe_missing": (["--k3-recipe", "/nope/recipe.yaml"], "--k3-recipe /nope/recipe.yaml: no such file"),
        "scenarios_none": (["--k3-scenarios", no_scen], f"--k3-scenarios '{no_scen}' matched no file"),
        "sample_interval_zero": (["--k3-sample-interval", "0"], "--k3-sample-interval must be > 0, got 0"),
        "startup_log_missing": (["--k3-startup-log", "/nope.log"], "--k3-startup-log /nope.log: no such file"),
        "processes_bad_option": (["--k3-sample-interval", "-1", *_processes()],
                                 "--k3-sample-interval must be > 0, got -1"),
    }
    return {name: Case(_locust(url, d[name], *extra), 2, said + line, d[name] / "out")
            for name, (extra, line) in cases.items()}


def _cli_cases(url: str, d: dict[str, Path]) -> dict[str, Case]:
    """`k3load` subcommands; the precheck keeps its own code 3 for "could not run" (2 is inconclusive)."""
    missing, recipe = d["analyze_missing_dir"] / "nope", _write(d["precheck_broken_recipe"] / "r.yaml", BROKEN_RECIPE)
    return {
        "analyze_missing_dir": Case(_k3load("analyze", str(missing)), 2,
                                    f"k3load analyze: {missing}: no such directory"),
        "precheck_broken_recipe": Case(_k3load("precheck", "--recipe", str(recipe), "--base-url", url, "--no-nvml",
                                               "--out", str(d["precheck_broken_recipe"] / "pc")), 3,
                                       f"k3load precheck: {recipe}:3:13: YAML error: mapping values are not "
                                       "allowed here"),
        "sample_interval_option": Case(_k3load("sample", "--metrics-url", f"{url}/metrics", "--interval", "0",
                                               "--out", str(d["sample_interval_option"] / "s")), 2,
                                       "k3load sample: --interval must be > 0, got 0"),
    }


def _cases(url: str, base: Path) -> dict[str, Case]:
    """Every case in its own folder, with a valid tiny plan unless the case breaks it."""
    d = {name: base / name for name in CASE_NAMES}
    for folder in d.values():
        _write(folder / "plan.yaml", yaml.safe_dump(TINY_PLAN))
    return {**_locust_cases(url, d), **_cli_cases(url, d)}


CASE_NAMES = ("processes_bad_option", "scenario_yaml", "plan_yaml", "recipe_yaml", "recipe_unknown_key",
              "recipe_missing", "scenarios_none", "sample_interval_zero", "startup_log_missing", "analyze_missing_dir",
              "precheck_broken_recipe", "sample_interval_option")


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str
    left_behind: bool  # a process of its group (a --processes worker) still alive after it exited


def _run(case: Case) -> Done:
    """In its own process group; whatever of the group outlives the command is noted, then killed."""
    proc = subprocess.Popen(case.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    left = _group_alive(proc.pid)
    if left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return Done(proc.returncode, stdout, stderr, left)


def _group_alive(pgid: int, wait_s: float = 3.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    return True


def _chat_counters(url: str) -> tuple[float, float]:
    with httpx.Client(timeout=10) as client:
        families = scrape(Target("sim", url, "tiny"), client)
    return total(families, "vllm:request_success_total"), total(families, "vllm:prompt_tokens_total")


def _says_error(line: str) -> bool:
    """A line that reports a problem: ours, an exception, a logged error (not Locust's summary table)."""
    return "k3load" in line or "error" in line.lower() or "exception" in line.lower()


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Case], dict[str, Done], tuple, tuple]]:
    """One sim; every case run against it (four at a time); its chat counters before and after."""
    base = tmp_path_factory.mktemp("harness-errors")
    sim = SimProcess(FAST_SIM, base / "sim.log").start()
    try:
        cases = _cases(sim.base_url, base)
        before = _chat_counters(sim.base_url)
        with ThreadPoolExecutor(max_workers=4) as pool:
            done = dict(zip(cases, pool.map(_run, cases.values()), strict=True))
        yield cases, done, before, _chat_counters(sim.base_url)
    finally:
        sim.stop()


@pytest.mark.parametrize("name", CASE_NAMES)
def test_a_harness_error_is_one_line_exit_2_and_no_load(ran, name: str) -> None:
    cases, done, before, after = ran
    case, proc = cases[name], done[name]
    said = proc.stdout + proc.stderr
    assert proc.returncode == case.exit_code, said
    assert "Traceback" not in said, said
    errors = [line for line in said.splitlines() if LOCUST_INFO not in line and _says_error(line)]
    assert errors == [case.line], said
    assert case.line in proc.stderr.splitlines(), "not on stderr"
    assert said.count(case.line.split(": ", 1)[1]) == 1  # said once, not also logged
    assert not proc.left_behind, "a process of the run outlived it"
    if case.run_dir is not None:
        assert not case.run_dir.exists(), "the run started: its directory was created"
    assert after == before == (0, 0), "the sim served a chat request"


# -- the checks themselves, without processes ------------------------------------------------------------
def test_a_yaml_error_is_one_line_with_file_line_and_column() -> None:
    with pytest.raises(YamlFileError) as err:
        load_yaml_text(BROKEN_MAPPING, "scenarios/x.yaml")
    assert str(err.value) == "scenarios/x.yaml:3:7: YAML error: mapping values are not allowed here"


def _options(**changes: object) -> SimpleNamespace:
    opts = dict(k3_sample_interval=1.0, k3_scrape_timeout=0.0, k3_max_restarts=3, k3_out="/nope/run",
                k3_recipe=str(ROOT / "recipes" / "local-dev.yaml"), k3_container_info="", k3_startup_log="",
                k3_custom_build="", k3_host_inventory=[])
    return SimpleNamespace(**{**opts, **changes})


@pytest.mark.parametrize(("changes", "message"), [
    ({"k3_scrape_timeout": -1.0}, "--k3-scrape-timeout must be >= 0 (0: from the interval), got -1"),
    ({"k3_max_restarts": -2}, "--k3-max-restarts must be >= 0, got -2"),
    ({"k3_server_log": "/var/log/vllm.log", "k3_server_log_cmd": "journalctl -fu vllm"},
     "--k3-server-log and --k3-server-log-cmd: give one, not both (a file the server writes its log to, or a "
     "command that prints it)"),
    ({"k3_host_inventory": [str(ROOT), "/nope/n2.json"]}, f"--k3-host-inventory {ROOT}: not a file"),
    ({"k3_custom_build": "/nope/build.yaml"}, "--k3-custom-build /nope/build.yaml: no such file"),
    ({"k3_out": str(ROOT / "README.md")}, f"--k3-out {ROOT / 'README.md'}: not a directory"),
    ({"k3_session_header": "X-Route", "k3_header": ["X-Gateway-Token: s3cr3t\nx-route: 1"]},
     "--k3-session-header X-Route: also a --k3-header (a gateway header, sent with its own value): name the header "
     "your router keys on"),
])
def test_option_errors_name_the_option_and_the_value(changes: dict, message: str) -> None:
    with pytest.raises(HarnessError) as err:
        check_options(_options(**changes))
    assert str(err.value) == message


def test_a_session_header_is_a_header_name_that_k3load_does_not_send_itself() -> None:
    for bad, words in (("X Route", "not a header name"), ("Authorization", "sent by k3load itself"),
                       ("x-request-id", "sent by k3load itself")):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            session_header(bad)
    assert session_header(" X-Session-Id ") == "X-Session-Id" and session_header("") == ""


def test_a_plan_name_that_is_not_there_names_the_option_and_the_plans(tmp_path: Path) -> None:
    _write(tmp_path / "smoke.yaml", "")
    with pytest.raises(HarnessError) as err:
        plan_path("smokey", tmp_path)
    assert str(err.value) == f"--k3-plan smokey: no such file ({tmp_path / 'smokey.yaml'}; plans: smoke)"
    with pytest.raises(HarnessError, match=r"^--k3-scenarios '/nope/\*\.yaml' matched no file$"):
        scenario_paths("/nope/*.yaml")


def test_the_locust_precheck_raises_on_a_recipe_it_cannot_use(tmp_path: Path) -> None:
    """The run-time path (the web UI may change --k3-recipe after `init`): no longer logged and skipped."""
    bad = _recipe_with(tmp_path, "colour: blue\n")
    opts = SimpleNamespace(k3_recipe=str(bad), k3_container_info="", k3_host_inventory=[], k3_startup_log="",
                           k3_image="", k3_custom_build="", k3_api_key="", k3_nvml="off", k3_metrics_url=[])
    run = SimpleNamespace(run_dir=tmp_path / "run", target=TargetApi(None, opts))
    with pytest.raises(RecipeError, match=r"\(top level\): Additional properties are not allowed"):
        observe.precheck(run, stop=lambda: None)
    assert not (tmp_path / "run" / "compat.json").exists()


def test_what_a_worker_sends_is_said_on_one_printable_bounded_line() -> None:
    """The worker port takes any message: a forged `k3_refused` with terminal escapes, a newline and a megabyte
    of text stops the run (as any refusal does) but prints one bounded line, its control characters as repr."""
    from types import SimpleNamespace

    from k3load.loadgen import listeners

    said: list[str] = []
    session = SimpleNamespace(fail=said.append)
    env = SimpleNamespace(k3_session=session, runner=None, shape_class=object,
                          parsed_options=SimpleNamespace(headless=False))
    listeners._worker_refused(env, {"host": "h\x1b[2J", "pid": 1, "why": "x\nk3load: forged line" + "y" * 10**6})
    (line,) = said
    assert "\x1b" not in line and "\n" not in line and len(line) < 2300 and "\\x1b[2J" in line
    listeners._worker_refused(env, ["not", "a", "dict"])  # a malformed message: said, never a traceback
    assert said[1] == "worker None:None cannot take part: None"
