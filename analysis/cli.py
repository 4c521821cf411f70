"""`k3load analyze DIR` and `k3load verify DIR` (dispatch only; the work is in analyze.py/manifest.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3load.analysis.verdict import EXIT_CODES
from k3load.evidence import records_file

if TYPE_CHECKING:
    from k3load.analysis.analyze import Judgment

HARNESS_ERROR_EXIT = 2  # not a run directory, an unreadable record, nothing judged: no verdict, nothing written


def run_dir_problem(path: Path) -> str | None:
    """Why `path` is not a run directory, or None. The one check before `analyze`, `verify` and `diff` read
    anything: a folder with neither run.json nor records (a README, a precheck's --out) is refused, since
    a verdict or a manifest written into it would look like a judgment of a run (issue 38)."""
    if not path.exists():
        return f"{path}: no such directory"
    if not path.is_dir():
        return f"{path}: not a directory"
    if not (path / "run.json").is_file() and not records_file(path).is_file():
        return f"{path}: not a run directory (no run.json, no {records_file(path).name})"
    return None


def add_analyze_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="a run directory written by locustfiles/agent.py")
    parser.add_argument("--accept-limited", action="store_true", help="exit 0 for `limited` as for `go`")
    parser.add_argument("--reference", type=Path, metavar="DIR",
                        help="judge the agent pillar also on agreement with this judged run (tool-call trigger F1, "
                        "schema accuracy; thresholds in the plan's agent_api): its run id, manifest hash and "
                        "profile are written to DIR/reference.json, so later `k3load analyze` re-judges the same")


def run_analyze(args: argparse.Namespace) -> int:
    from k3load.analysis.analyze import NothingJudged, analyze

    if problem := run_dir_problem(args.run_dir):
        print(f"k3load analyze: {problem}", file=sys.stderr)
        return HARNESS_ERROR_EXIT
    if getattr(args, "reference", None) is not None and not _set_reference(args.run_dir, args.reference):
        return HARNESS_ERROR_EXIT
    from k3load.analysis.run.rundata import UnreadableRecords
    from k3load.signing.record import stale_sets

    stale_before = len(stale_sets(args.run_dir))
    try:
        judgment = analyze(args.run_dir, plots_beside=True)  # a plain process: plots drawn in a child
    except (UnreadableRecords, NothingJudged) as exc:
        print(f"k3load analyze: {exc}", file=sys.stderr)
        return HARNESS_ERROR_EXIT
    for folder, signers in stale_sets(args.run_dir)[stale_before:]:
        print(f"k3load analyze: the new manifest.sha256 is not the one that was signed: its {len(signers)} "
              f"signature(s) ({', '.join(s.identity for s in signers) or 'unnamed'}) no longer cover the run; "
              f"kept, stale, in {folder} with the manifest they signed (sign again: k3load sign)", file=sys.stderr)
    print(summary_line(judgment, args.run_dir))
    if judgment.verdict == "limited" and args.accept_limited:
        return 0
    return judgment.exit_code


def _set_reference(run_dir: Path, reference: Path) -> bool:
    """Write the reference's record into the run directory (the analysis reads nothing outside it)."""
    from k3load.analysis.pillars.agent.agreement import REFERENCE_FILE, ReferenceRunError, reference_record
    from k3load.rundir import write_json_atomic

    try:
        record = reference_record(reference)
    except ReferenceRunError as exc:
        print(f"k3load analyze: {exc}", file=sys.stderr)
        return False
    write_json_atomic(run_dir / REFERENCE_FILE, record)
    return True


def summary_line(judgment: Judgment, run_dir: Path) -> str:
    verdict = judgment.verdict
    pillars = ", ".join(f"{k} {p.status}" for k, p in judgment.pillars.items())
    because = "; ".join(judgment.because[:3])
    return (f"k3load verdict: {verdict} ({pillars})\n  because: {because}\n"
            f"  report: {run_dir / 'report.html'} (exit code {EXIT_CODES[verdict]})")


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="a judged run directory (its manifest.sha256 is checked)")
    parser.add_argument("--allowed-signers", type=Path, metavar="FILE",
                        help="OpenSSH allowed-signers file (as git's gpg.ssh.allowedSignersFile): each signature "
                             "must verify as one of its principals")
    parser.add_argument("--require-signature", action="store_true",
                        help="fail when the run carries no signature (k3load sign)")


def run_verify(args: argparse.Namespace) -> int:
    from k3load.analysis.outputs.manifest import verify
    from k3load.signing import keygen, record

    if problem := run_dir_problem(args.run_dir):
        print(f"k3load verify: {problem}", file=sys.stderr)
        return HARNESS_ERROR_EXIT
    if args.allowed_signers is not None and not args.allowed_signers.is_file():
        print(f"k3load verify: --allowed-signers {args.allowed_signers}: no such file", file=sys.stderr)
        return HARNESS_ERROR_EXIT
    problems = verify(args.run_dir)
    try:
        checks = [] if problems and not (args.run_dir / record.MANIFEST).exists() else \
            record.check_signatures(args.run_dir, args.allowed_signers)
    except keygen.SigningError as exc:
        print(f"k3load verify: {exc}", file=sys.stderr)
        return HARNESS_ERROR_EXIT
    for problem in problems:
        print(problem)
    for check in checks:
        print(record.describe(check))
    problems += [record.describe(c) for c in checks if not c.ok]
    if (args.run_dir / record.MANIFEST).exists():
        for problem in record.consistency_problems(args.run_dir):
            print(problem)
            problems.append(problem)
    if not checks and args.require_signature:
        problems.append("no signature (--require-signature)")
        print(f"no signature: {record.SIGNATURES} is missing or empty (k3load sign)")
    for folder, signers in record.stale_sets(args.run_dir):
        print(f"stale: {len(signers)} signature(s) ({', '.join(s.identity for s in signers) or 'unnamed'}) over an "
              f"earlier manifest, kept in {folder.relative_to(args.run_dir)}: they do not cover this run")
    print(f"k3load verify: {'FAILED' if problems else 'ok'} ({args.run_dir}){_signed_said(checks, args)}")
    return 1 if problems else 0


def _signed_said(checks: list[Any], args: argparse.Namespace) -> str:
    from k3load.signing import record

    if not checks:
        return "; not signed"
    if args.allowed_signers is None:
        return f"; {len(checks)} signature(s), signers not checked (no --allowed-signers)"
    good = sorted({p for c in checks if c.status == record.SignatureStatus.OK for p in c.principals})
    return f"; signed by {', '.join(good)}" if good else ""
