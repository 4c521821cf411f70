"""Pillar 2, headroom under load: the stage table, limit rules, drains, crashes, restarts, GPU memory growth."""
