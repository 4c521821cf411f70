"""Bring your own traffic: agent request logs turned into scenarios (issue 28)."""
