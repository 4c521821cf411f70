"""Real serving targets the harness can start: a vLLM server on this machine's CPU (vllm_cpu)."""
