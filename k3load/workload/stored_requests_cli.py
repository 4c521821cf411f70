"""`k3load samples`: write (or `--check`) the canonical request bodies the scenarios produce.

Canonical means byte for byte as sent, never sorted: a body keeps the key order its scenario
declares, all the way down (chat templates render property order, so it is part of the prompt); only
whitespace is normalised. `--check` exits 1 when a stored body differs from what the scenarios produce
now; when its key order differs it names the first key path whose order differs, with both orders.

The repository keeps them under `samples/requests/` for the production model name and context
(`kimi-k3`, 32,768 tokens as on the Hopper recipe, long inputs sized by a 3.5 chars/token estimate);
every run also writes the bodies it actually sent to `DIR/samples/` with `DIR/samples.sha256`.
"""

from __future__ import annotations

import argparse
import glob
from pathlib import Path

from k3load.workload.long_input import estimate_tokens, long_context_for
from k3load.workload.scenario import Scenario, ScenarioError, load_scenarios
from k3load.workload.stored_requests import check_stored_requests, write_stored_requests


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenarios", default="scenarios/*.yaml", help="glob of scenario files")
    parser.add_argument("--out", type=Path, default=Path("samples/requests"),
                        help="where the stored requests are written (or checked)")
    parser.add_argument("--model", default="kimi-k3", help="model name written into the bodies")
    parser.add_argument("--max-model-len", type=int, default=32768, help="context that sizes long inputs")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on any difference")


def run(args: argparse.Namespace) -> int:
    try:
        scenarios = load_scenarios([Path(p) for p in sorted(glob.glob(args.scenarios))])
    except ScenarioError as exc:
        print(f"k3load samples: {exc}")
        return 2
    count = estimate_tokens()

    def context(scenario: Scenario) -> str | None:
        return long_context_for(scenario, args.max_model_len, count)

    if args.check:
        problems = check_stored_requests(scenarios, args.out, args.model, context)
        for problem in problems:
            print(problem)
        print(f"k3load samples: {'stale' if problems else 'up to date'} ({args.out})")
        return 1 if problems else 0
    sums = write_stored_requests(scenarios, args.out, args.model, context)
    print(f"k3load samples: wrote {len(sums)} bodies and SHA256SUMS to {args.out}")
    return 0
