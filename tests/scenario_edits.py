"""Copies of the shipped scenarios, edited for one test (the shipped files stay as they are)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def short_control_prompt(folder: Path) -> str:
    """scenarios/*.yaml into `folder`, the shared-prefix control cut to a few tokens (no tools, no
    context), so its prompt is shorter than one cache block; returns the glob for --k3-scenarios."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in (ROOT / "scenarios").glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        if data["family"] == "shared_prefix":
            data["system_prompt"], data["context"], data["tools"], data["executors"] = "Be brief.", [], [], {}
            for turn in data["turns"]:
                turn["expect"] = {"kind": "answer"}
        (folder / path.name).write_text(yaml.safe_dump(data))
    return str(folder / "*.yaml")
