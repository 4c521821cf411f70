"""Turn an agent's request log into scenarios that k3load plays as they are.

    k3load import agent.jsonl.gz --name support --out scenarios/support
    k3load import batch_input.jsonl batch_output.jsonl --name nightly --out scenarios/nightly --sample 50
    locust -f locustfiles/agent.py --headless ... --k3-scenarios 'scenarios/support/*.yaml'

Each LOG holds JSON lines in any of these forms: a Chat Completions request body as the agent sent it;
`{"request": BODY, "response": ANSWER}` with the answer it got; the OpenAI Batch input format
(`custom_id`, `method`, `url`, `body`), whose answers are read from the Batch output file given beside it
(joined by `custom_id`). `.gz` files are read as gzip.

What is written, into the fresh folder DIR (it must not exist, or be empty): one scenario per
conversation (`NAME_0001.yaml`, ...: `mode: logged`, each request's body as logged, key order included,
the turns a conversation's requests were, the expectations its recorded answers give), and
`import.json`, the summary: lines read, lines refused (`file:line: why`), conversations, duplicates,
secrets replaced (how many of each kind, never the values).

Secrets and personal data are replaced before anything is written: API keys and bearer tokens, private
keys, e-mail addresses and phone numbers (k3load.traffic.redact), and what `--redact-pattern` adds, by
stable placeholders of about the same length. `--no-redact` keeps them, and the summary says so.

Exit codes: 0 written (refused lines named on stderr and in import.json); 2 nothing written: bad usage,
an unreadable log, no chat request in it, DIR not empty, or, with --strict, any refused line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3load.traffic import sample, scenario_files
from k3load.traffic.exchanges import Exchange, Problem, read_exchanges
from k3load.traffic.log_lines import MAX_LINE_BYTES, LogFileError
from k3load.traffic.threads import Conversation, rebuild
from k3load.workload import logged

if TYPE_CHECKING:
    from k3load.traffic.redact import LogRedactor

EXIT_WRITTEN, EXIT_NOTHING_WRITTEN = 0, 2
SUMMARY_FILE = "import.json"
# cold is salted per request and long_input sized to the server by k3load: a logged request is neither
IMPORT_FAMILIES = ("agent", "shared_prefix")
SHOWN_PROBLEMS = 20  # on stderr; import.json lists up to MAX_LISTED_PROBLEMS
MAX_LISTED_PROBLEMS = 1000


class ImportFailed(Exception):
    """Nothing was written: the message says why, in one line."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", metavar="LOG", nargs="+", type=Path,
                        help="the agent's request log(s): JSON lines (.gz read as gzip); a Batch input file "
                             "with its output file beside it")
    parser.add_argument("--name", required=True, help="the scenarios' name stem (NAME_0001, ...)")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--family", default="agent", choices=IMPORT_FAMILIES,
                        help="the family the scenarios belong to in a plan's mix (default agent; cold and "
                             "long_input are built by k3load, never logged)")
    parser.add_argument("--sample", type=int, metavar="N",
                        help="write at most N conversations, a representative subset by tool set and length")
    parser.add_argument("--redact-pattern", action="append", default=[], metavar="REGEX",
                        help="also replace what this Python regex matches (repeatable)")
    parser.add_argument("--no-redact", action="store_true",
                        help="write secrets and personal data as logged (the summary says so)")
    parser.add_argument("--strict", action="store_true", help="any refused line: write nothing, exit 2")
    parser.add_argument("--max-line-bytes", type=int, default=MAX_LINE_BYTES, metavar="BYTES",
                        help=f"the body cap: a longer line is refused (default {MAX_LINE_BYTES:,})")


def scenario_stem(name: str) -> str:
    """NAME as a scenario name stem (`^[a-z0-9_]+$`)."""
    stem = "".join(c if c.isascii() and c.isalnum() else "_" for c in name.lower()).strip("_")
    if not stem:
        raise ImportFailed(f"--name {name!r}: needs a letter or digit (scenario names are [a-z0-9_])")
    return stem


def run(args: argparse.Namespace) -> int:
    try:
        summary = import_logs(args)
    except ImportFailed as exc:
        print(f"k3load import: {exc}; nothing written", file=sys.stderr)
        return EXIT_NOTHING_WRITTEN
    _print_summary(summary, args.out)
    return EXIT_WRITTEN


def import_logs(args: argparse.Namespace) -> dict[str, Any]:
    """Read, redact, rebuild, sample, write (all or nothing); the summary written as import.json."""
    stem = scenario_stem(args.name)
    if args.sample is not None and args.sample < 1:
        raise ImportFailed(f"--sample {args.sample}: must be at least 1")
    from k3load.traffic.redact import LogRedactor, RedactPatternError  # its patterns compile on first use only

    try:
        scenario_files.check_out_dir(args.out)
        redactor = None if args.no_redact else LogRedactor(args.redact_pattern)
        exchanges, problems = read_exchanges(args.logs, args.max_line_bytes)
    except (scenario_files.OutDirError, RedactPatternError, LogFileError) as exc:
        raise ImportFailed(str(exc)) from None
    said = redactor.text if redactor is not None else str  # what a line's reason or a path quotes: redacted too
    problems = [Problem(said(p.where), said(p.reason)) for p in problems]
    if problems and args.strict:
        raise ImportFailed(f"--strict: {len(problems)} line(s) refused, first {problems[0]}")
    if not exchanges:
        first = f" (first refused: {problems[0]})" if problems else ""
        raise ImportFailed(f"no chat request in {said(', '.join(map(str, args.logs)))}{first}")
    if redactor is not None:
        exchanges = [_redacted(e, redactor) for e in exchanges]
    conversations, duplicates = rebuild(exchanges)
    chosen = conversations if args.sample is None else sample.representative(conversations, args.sample)
    log_names = said(", ".join(str(p) for p in args.logs))
    files = {f"{stem}_{i:04d}.yaml": scenario_files.to_yaml(
        scenario_files.scenario_of(c, f"{stem}_{i:04d}", args.family, log_names)) for i, c in enumerate(chosen, 1)}
    summary = _summary(args, exchanges, problems, conversations, chosen, duplicates, redactor)
    summary["logs"] = [said(str(p)) for p in args.logs]
    files[SUMMARY_FILE] = json.dumps(summary, indent=2, ensure_ascii=False) + "\n"
    try:
        scenario_files.write_all(args.out, files)
    except (scenario_files.OutDirError, OSError) as exc:
        raise ImportFailed(f"--out {args.out}: {exc}") from None
    return summary


def _redacted(exchange: Exchange, redactor: LogRedactor) -> Exchange:
    answer = redactor.value(exchange.answer) if exchange.answer is not None else None
    return Exchange(redactor.text(exchange.where), redactor.value(exchange.body), answer)


def _summary(args: argparse.Namespace, exchanges: list[Exchange], problems: list[Problem],
             conversations: list[Conversation], chosen: list[Conversation], duplicates: int,
             redactor: LogRedactor | None) -> dict[str, Any]:
    turns = [t for c in chosen for t in c.turns]
    normalised: list[str] = []
    for name, tool in _distinct_tools(turns).items():
        changes: list[str] = []
        logged.normalised_schema(((tool.get("function") or {}).get("parameters")), changes)
        normalised += [f"{name}: {c}" for c in changes]
    streamed_bare = sum(1 for t in turns if t.body.get("stream") is True and
                        not (t.body.get("stream_options") or {}).get("include_usage"))
    redaction: dict[str, Any] = {"enabled": redactor is not None}
    if redactor is not None:
        redaction |= {"replaced": redactor.counts(), "distinct_values": redactor.distinct(),
                      "extra_patterns": len(args.redact_pattern)}
    return {
        "logs": [str(p) for p in args.logs], "name": scenario_stem(args.name), "family": args.family,
        "requests": len(exchanges), "refused_lines": len(problems),
        "refused": [{"where": p.where, "reason": p.reason} for p in problems[:MAX_LISTED_PROBLEMS]],
        "duplicates": duplicates, "conversations": len(conversations), "written": len(chosen),
        "sample": args.sample, "turns": len(turns),
        "turns_with_answer": sum(1 for t in turns if t.answer is not None),
        "streamed_without_usage": streamed_bare, "tool_schemas_normalised_for_validation": normalised,
        "redaction": redaction}


def _distinct_tools(turns: list[Exchange]) -> dict[str, dict[str, Any]]:
    tools: dict[str, dict[str, Any]] = {}
    for turn in turns:
        for tool in logged.request_tools(turn.body):
            name = logged.tool_name(tool)
            if name and name not in tools:
                tools[name] = tool
    return tools


def _print_summary(summary: dict[str, Any], out: Path) -> None:
    for problem in summary["refused"][:SHOWN_PROBLEMS]:
        print(f"k3load import: refused {problem['where']}: {problem['reason']}", file=sys.stderr)
    if summary["refused_lines"] > SHOWN_PROBLEMS:
        print(f"k3load import: ... {summary['refused_lines'] - SHOWN_PROBLEMS} more refused lines in "
              f"{out / SUMMARY_FILE}", file=sys.stderr)
    redaction = summary["redaction"]
    said = "redaction off (--no-redact): secrets and personal data written as logged" \
        if not redaction["enabled"] else "replaced " + (", ".join(
            f"{n} {kind}" for kind, n in redaction["replaced"].items() if n) or "no secret or personal data")
    print(f"k3load import: {summary['requests']} requests ({summary['duplicates']} duplicates counted once) -> "
          f"{summary['conversations']} conversations; wrote {summary['written']} scenarios ({summary['turns']} "
          f"turns) to {out}; {said}")
    if summary["streamed_without_usage"]:
        print(f"k3load import: {summary['streamed_without_usage']} streamed requests ask for no usage "
              "(stream_options.include_usage): sent as logged, their token counts will be unknown")
