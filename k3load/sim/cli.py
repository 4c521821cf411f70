"""`k3load sim` options: one flag per SimConfig/FaultProfile field, its help text the field's own.

Why generated from the dataclasses: a knob that exists in a profile but not on the command line (or
the other way round) is a trap, and a fault described twice drifts; each field carries its one
description (`k3load.sim.config.knob`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path

from k3load.sim.config import FaultProfile, ProfileError, SimConfig, load_profile, validate


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", type=Path, help="YAML profile with 'engine:' and 'faults:' sections; "
                        "flags given on the command line override it")
    for group_name, cls in (("engine", SimConfig), ("faults", FaultProfile)):
        group = parser.add_argument_group(group_name)
        for field in dataclasses.fields(cls):
            if field.name == "faults":
                continue
            default = getattr(cls(), field.name)
            kind = type(default)
            text = f"{field.metadata['help']} (default: {default})"
            if kind is bool:
                group.add_argument(_flag(field.name), action=argparse.BooleanOptionalAction, default=None,
                                   help=text)
            else:
                group.add_argument(_flag(field.name), type=kind, default=None, help=text)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Profile first, then explicit flags on top."""
    config = load_profile(args.profile) if args.profile else SimConfig()
    for target in (config, config.faults):
        for field in dataclasses.fields(target):
            value = getattr(args, field.name, None)
            if field.name != "faults" and value is not None:
                setattr(target, field.name, value)
    validate(config)
    return config


def run(args: argparse.Namespace) -> int:
    from k3load.sim.server import serve  # aiohttp only when serving

    try:
        config = config_from_args(args)
    except ProfileError as exc:
        print(f"k3load sim: {exc}")
        return 2
    asyncio.run(serve(config))
    return 0
