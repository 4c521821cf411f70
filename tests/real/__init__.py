"""Tests against the real vLLM CPU server (marker `vllm`; its venv and models are built on first use) and,
where a file compares both, the sim beside it. Minutes each."""
