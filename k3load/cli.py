"""The `k3load` command: dispatch only; each subcommand lives with the code it runs."""

from __future__ import annotations

import argparse
import sys

from k3load import __version__, demo
from k3load.analysis import capacity_cli
from k3load.analysis import cli as analysis_cli
from k3load.analysis import diff as diff_cli
from k3load.analysis.verdict import EXIT_CODES
from k3load.precheck import cli as precheck_cli
from k3load.precheck import inventory as inventory_cli
from k3load.sampler import cli as sampler_cli
from k3load.signing import sign_cli
from k3load.sim import cli as sim_cli
from k3load.traffic import import_cli
from k3load.workload import stored_requests_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3load", description=__doc__)
    parser.add_argument("--version", action="version", version=f"k3load {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("sim", help="run the embedded vLLM-compatible simulator (never evidence)",
                         description="Embedded vLLM-compatible server for rehearsal and tests. Its numbers "
                         "model vLLM's behaviour; they are never evidence for a production verdict.")
    sim_cli.add_arguments(sim)
    sim.set_defaults(func=sim_cli.run)
    samples = sub.add_parser("samples", help="write or check the request bodies scenarios send (declared key order)",
                             description=stored_requests_cli.__doc__)
    stored_requests_cli.add_arguments(samples)
    samples.set_defaults(func=stored_requests_cli.run)
    analyze = sub.add_parser("analyze", help="judge a run directory: verdict.json, reports, alerts, manifest",
                             description="Judge a run directory (the whole evidence) into verdict.json, "
                             "report.md/html, alerts.yaml, dashboard.json and manifest.sha256. Exit codes: "
                             + ", ".join(f"{k} {v}" for k, v in EXIT_CODES.items()) + ".")
    analysis_cli.add_analyze_arguments(analyze)
    analyze.set_defaults(func=analysis_cli.run_analyze)
    diff = sub.add_parser("diff", help="compare run B with reference run A; non-zero exit when B is worse",
                          description=diff_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog=f"Exit codes: 0 no regression beyond the thresholds, {diff_cli.DIFF_WORSE_EXIT} B "
                          "worse than A beyond the thresholds of B's plan (thresholds.diff), 2 bad input.")
    diff_cli.add_arguments(diff)
    diff.set_defaults(func=diff_cli.run)
    capacity = sub.add_parser("capacity", help="the capacity plan of a judged run, for your targets: replicas, GPUs, "
                              "cost", description=capacity_cli.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    capacity_cli.add_arguments(capacity)
    capacity.set_defaults(func=capacity_cli.run)
    sign = sub.add_parser("sign", help="sign a judged run's manifest.sha256 with your OpenSSH key (several "
                          "signers may)", description=sign_cli.__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    sign_cli.add_arguments(sign)
    sign.set_defaults(func=sign_cli.run)
    verify = sub.add_parser("verify", help="re-check a run directory against its manifest.sha256 and its "
                            "signatures", description="Re-check every evidence file of a judged run directory "
                            "against its manifest.sha256, and every signature (k3load sign) against the manifest "
                            "and, with --allowed-signers, the team's allowed signers: exit 0 when all hold "
                            "(naming who signed), 1 when a file changed or is missing, a signature does not match "
                            "or its signer is not allowed, or (--require-signature) there is none; 2 bad input.")
    analysis_cli.add_verify_arguments(verify)
    verify.set_defaults(func=analysis_cli.run_verify)
    precheck = sub.add_parser("precheck", help="compat precheck against a versioned recipe -> compat.json",
                              description=precheck_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    precheck_cli.add_arguments(precheck)
    precheck.set_defaults(func=precheck_cli.run)
    inventory = sub.add_parser("inventory", help="this node's GPU inventory (nvidia-smi) as --host-inventory JSON",
                               description=inventory_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    inventory_cli.add_arguments(inventory)
    inventory.set_defaults(func=inventory_cli.run)
    sample = sub.add_parser("sample", help="run the side sampler (/metrics, /health, GPUs, server log) into a "
                            "run directory", description=sampler_cli.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sampler_cli.add_arguments(sample)
    sample.set_defaults(func=sampler_cli.run)
    importer = sub.add_parser("import", help="turn an agent's request log into scenarios that play as logged "
                              "(secrets replaced)", description=import_cli.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    import_cli.add_arguments(importer)
    importer.set_defaults(func=import_cli.run)
    demo_parser = sub.add_parser("demo", help="full acceptance run against the embedded sim, ending in a report",
                                 description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=demo.run)
    return parser


RUN_DIR_COMMANDS = ("analyze", "verify", "capacity", "sign")
HARNESS_ERROR_EXIT = analysis_cli.HARNESS_ERROR_EXIT  # a usage or input error: nothing was judged (argparse's too)


def _missing_run_dir(args: argparse.Namespace) -> str | None:
    """`analyze` / `verify` on a path that is not a run directory (no such directory, a file, a folder
    with neither run.json nor records): said before anything is read or written, naming the path (a
    verdict or a "FAILED" on nothing would look like a judgment). The check is analysis.cli.run_dir_problem."""
    if args.command not in RUN_DIR_COMMANDS:
        return None
    problem = analysis_cli.run_dir_problem(args.run_dir)
    return f"k3load {args.command}: {problem}" if problem else None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = _missing_run_dir(args)
    if problem:
        print(problem, file=sys.stderr)
        return HARNESS_ERROR_EXIT
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
