"""A command the operator gave (--k3-server-log-cmd, --k3-restart-cmd), as a run may write it down.

    command_program("VLLM_API_KEY=sk-1 systemctl restart vllm")   # "systemctl"
    withheld("kubectl logs -f vllm-0 --token=eyJ...")             # "kubectl … (arguments withheld: ...)"

Why only the program: such a command often carries a credential (`kubectl … --token=…`,
`VLLM_API_KEY=… systemctl restart vllm`, `curl -H 'Authorization: …'`) that is no API key or header the
run knows of, so no redaction can find it. Its program says what kind of thing ran; its arguments stay
out of every file (run.json, events, logs, reports). Leading `NAME=value` assignments, `env` and its
options, and wrappers that only run the rest (`exec`, `sudo`, `nohup`, `timeout 5`...) are skipped to
reach the program; for `bash -c '...'` the program is `bash`. A command that does not parse as shell
words says only that it was withheld.
"""

from __future__ import annotations

import os
import re
import shlex

NOTE = "arguments withheld: they may hold tokens"
UNPARSED = "(withheld: not a command line that could be read)"
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_WRAPPERS = {"exec", "sudo", "nohup", "env", "command", "nice", "ionice", "setsid", "stdbuf", "time", "timeout",
             "doas", "chrt", "taskset"}


def command_program(command: str | list[str] | None) -> str | None:
    """The program `command` runs, as written (`kubectl`, `/usr/bin/kubectl`); None for no command, UNPARSED
    when it cannot be split into shell words."""
    if not command:
        return None
    try:
        words = shlex.split(command) if isinstance(command, str) else list(command)
    except ValueError:
        return UNPARSED
    for i, word in enumerate(words):
        name = os.path.basename(word)
        if _ASSIGNMENT.match(word) or word.startswith("-") or (name in _WRAPPERS and i + 1 < len(words)):
            continue  # an assignment, a wrapper or one of its options: the program is further on
        if re.fullmatch(r"[0-9.]+[smhd]?", word) and i and os.path.basename(words[i - 1]) in _WRAPPERS:
            continue  # `timeout 5`, `nice 10`
        return word or UNPARSED
    return UNPARSED


def withheld(command: str | list[str] | None) -> str:
    """`command` as a run writes it: "PROGRAM … (arguments withheld: they may hold tokens)"; "" for none."""
    program = command_program(command)
    if program is None:
        return ""
    return program if program == UNPARSED else f"{program} … ({NOTE})"
