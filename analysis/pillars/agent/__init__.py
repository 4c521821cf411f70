"""Pillar 4, agent API correctness: tool calls, structured output, reproducibility, retries, agreement rates."""
