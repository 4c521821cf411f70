"""Run the property tests (`pytest -m fuzz`) for a time budget: round after round, each with a fresh seed
and Hypothesis's `fuzz` profile (tests/conftest.py), until SECONDS are spent or a round fails.

    make fuzz SECONDS=600            # or: .venv/bin/python scripts/fuzz.py --seconds 600 [-- PYTEST ARGS]

Why rounds and not one long run: Hypothesis has no time budget of its own, only a number of examples per
test; a round is every property test once, at the profile's examples, and a new seed draws new examples.
A failure prints the falsifying example and the seed that found it (and stays in .hypothesis/, so the
next run tries it first): add it to the test as an `@example` so `make test` keeps it for good.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300, help="time budget (a round already begun ends)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
    args = parser.parse_args(argv)
    deadline, rounds = time.monotonic() + args.seconds, 0
    env = {**os.environ, "K3_HYPOTHESIS_PROFILE": "fuzz"}
    while time.monotonic() < deadline:
        seed = random.SystemRandom().randrange(2**32)
        rounds += 1
        print(f"fuzz round {rounds}, seed {seed}", flush=True)
        cmd = [sys.executable, "-m", "pytest", "-m", "fuzz", "-q", "-p", "no:cacheprovider",
               f"--hypothesis-seed={seed}", *args.pytest_args]
        code = subprocess.call(cmd, cwd=ROOT, env=env)
        if code != 0:
            print(f"fuzz: round {rounds} failed (seed {seed}): add the falsifying example above as an @example",
                  flush=True)
            return code
    print(f"fuzz: {rounds} round(s) passed in {args.seconds:g} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
