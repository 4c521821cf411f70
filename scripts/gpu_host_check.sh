#!/bin/bash
# The harness's GPU paths end to end on a host with an NVIDIA GPU, in about two minutes:
#   1. scripts/gpu_nvml_check.py: the sampler's NVML memory curve follows an allocation and its release;
#   2. pytest -m gpu (the same check as a test);
#   3. `k3load demo` with the sampler's NVML on while torch allocates 8, 16 and 24 GiB in steps beside it,
#      then a summary of gpu.jsonl per source and GPU, and the resources pillar;
#   4. `k3load precheck --recipe recipes/kimi-k3.yaml` with only this host's NVML inventory.
#
#     bash scripts/gpu_host_check.sh [RESULTS_DIR]      (default ./gpu-check; replaced)
#
# Needs python3 with torch (for the allocations) and the harness's dependencies. Where they cannot be
# installed (a machine without a registry), put their wheels in $K3_WHEELS: they are installed into a
# scratch folder and the checkout is used as the package (analysis/ linked as k3load/analysis, as setup.py
# installs it). Run on Dec 4 2026 on one H200: docs/tests.md says what it printed. Exit status: that of
# the NVML check (0 PASS, 1 FAIL, 2 cannot test here).
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 3
R=$(realpath -m "${1:-gpu-check}"); rm -rf "$R"; mkdir -p "$R"
nvidia-smi > "$R/nvidia-smi.txt" 2>&1; head -12 "$R/nvidia-smi.txt"

echo "== 1 scripts/gpu_nvml_check.py"
timeout 150 python3 scripts/gpu_nvml_check.py --out "$R/nvml" 2>&1 | tee "$R/nvml.log"
nvml_rc=$?

if [ -n "$K3_WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$R/site" \
    "$K3_WHEELS"/*.whl || exit 3
  export PYTHONPATH="$R/site:$PWD"
  [ -e k3load/analysis ] || ln -s ../analysis k3load/analysis
fi

echo "== 2 pytest -m gpu"
timeout 150 python3 -m pytest -p no:cacheprovider -m gpu tests/unit/test_gpu_nvml.py -rs -q 2>&1 | tail -4

echo "== 3 k3load demo with NVML on; torch allocates 8, 16, 24 GiB beside it, then frees them"
env -u PYTHONPATH python3 - > "$R/alloc.log" 2>&1 <<'PY' &
import json, time
import torch
blocks = []
time.sleep(10)
for _ in range(3):
    blocks.append(torch.ones(8 << 30, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    print(json.dumps({"ts": time.time(), "held_gib": 8 * len(blocks)}), flush=True)
    time.sleep(15)
blocks.clear()
torch.cuda.empty_cache()
print(json.dumps({"ts": time.time(), "held_gib": 0}), flush=True)
PY
alloc=$!
timeout 300 python3 -m k3load demo --out "$R/demo" 2>&1 | tail -6
wait $alloc
cat "$R/alloc.log"
python3 - "$R/demo" <<'PY'
import collections, json, pathlib, sys
run = pathlib.Path(sys.argv[1])
rows = [json.loads(line) for line in (run / "gpu.jsonl").read_text().splitlines()] if (run / "gpu.jsonl").exists() else []
by_gpu = collections.defaultdict(list)
for r in rows:
    by_gpu[(r["source"], r["gpu"], r["name"])].append(r["memory_used_mib"])
for key, used in sorted(by_gpu.items(), key=str):
    print(key, len(used), "readings, memory_used_mib", min(used), "to", max(used))
verdict = json.loads((run / "verdict.json").read_text()) if (run / "verdict.json").exists() else {}
resources = verdict.get("pillars", {}).get("resources", {})
print("verdict", verdict.get("verdict"), "| resources", resources.get("status"), resources.get("reasons"))
PY

echo "== 4 k3load precheck, recipes/kimi-k3.yaml, this host's NVML only"
timeout 60 python3 -m k3load precheck --recipe recipes/kimi-k3.yaml --out "$R/precheck" 2>&1 | tail -16
[ -n "$OUT" ] && tar czf "$OUT/gpu-check.tgz" --exclude=site -C "$(dirname "$R")" "$(basename "$R")"
exit $nvml_rc
