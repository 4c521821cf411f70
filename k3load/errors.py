"""One root for the errors a user's input causes: a bad scenario, plan, trace, log, recipe, key or run directory.

Why: the Locust listeners and the CLIs turn these into a one-line message naming the file and the field, with
exit code 2; anything else is a bug in the harness and keeps its traceback. Catching `ValueError` instead would
print a programming error (a bad unpacking, a wrong int()) as the user's fault. Each module's own error class
derives from `InputError` and stays a `ValueError`, so callers that caught it as one still do.
"""

from __future__ import annotations


class InputError(ValueError):
    """The user's input is wrong; the message says which file and field, and what to change."""
