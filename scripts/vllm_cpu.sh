#!/usr/bin/env bash
# Real vLLM on this machine's CPU: install | build-model | serve [--port N] [--enforce-eager] [-- VLLM_FLAGS...]
# Thin wrapper over k3load/targets/vllm_cpu.py; PYTHON defaults to the repo's .venv (the harness venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3.11
exec "$PYTHON" -m k3load.targets.vllm_cpu "$@"
