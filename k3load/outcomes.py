"""The words every judgment is told in: a rule's or pillar's status, the pillars, the verdict, the layer a
failure is blamed on, and the signal a breach is evidence of.

Why one place: the precheck's rules, the pillars and the verdict all write `status`, and validation,
the pillars and the reports all read `layer`; spelled in one module, a new status or layer is added
once and a typo is an AttributeError, not a rule that silently never matches. Each is a StrEnum, so a
member compares equal to, and serialises as (json, f-strings), the very string written before: a run's
verdict.json is byte for byte what it was. (PyYAML's safe dumper refuses str subclasses: whatever goes
into a YAML document passes `.value`.) An attempt's own outcome, `ok`/`http_error`/`timeout`/..., is
the client's: `k3load.client.result.STATUSES`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class Status(StrEnum):
    """A rule's or a pillar's status. NOT_RUN: a pillar whose stages never ran; NOT_APPLICABLE: a precheck
    rule the deployment gives no occasion for (say, a custom-build record on a stock image)."""

    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    NOT_RUN = "not_run"
    NOT_APPLICABLE = "not_applicable"


# The members by their old names, typed `str` so a caller that mixes them with plain strings still checks.
PASS: Final[str] = Status.PASS
FAIL: Final[str] = Status.FAIL
INCONCLUSIVE: Final[str] = Status.INCONCLUSIVE
NOT_RUN: Final[str] = Status.NOT_RUN
NOT_APPLICABLE: Final[str] = Status.NOT_APPLICABLE


class Layer(StrEnum):
    """Who is to blame for a failed attempt, upstream first: the model's output, vLLM's tool/reasoning
    parser, the vLLM server itself (its own JSON error bodies, its context-length refusal), a gateway or
    proxy in front of it (HTML pages, 502/503/504, 429 with Retry-After, resets, cut streams), our client.
    (k3load.workload.validate's findings and `primary_layer` give them.)"""

    MODEL_OUTPUT = "model_output"
    PARSER = "parser"
    SERVER = "server"
    GATEWAY = "gateway"
    CLIENT = "client"


MODEL_OUTPUT: Final[str] = Layer.MODEL_OUTPUT
PARSER: Final[str] = Layer.PARSER
SERVER: Final[str] = Layer.SERVER
GATEWAY: Final[str] = Layer.GATEWAY
CLIENT: Final[str] = Layer.CLIENT
LAYERS: Final[tuple[str, ...]] = tuple(Layer)


class Pillar(StrEnum):
    """The four things an acceptance proves, in verdict.json's order of judging (analysis/analyze.py)."""

    COMPAT = "compat"
    RESOURCES = "resources"
    PREFIX_CACHE = "prefix_cache"
    AGENT_API = "agent_api"


class Verdict(StrEnum):
    """The four-way verdict (analysis/verdict.py decides it, in the spec's order)."""

    GO = "go"
    LIMITED = "limited"
    REBUILD = "rebuild"
    SCALE_UP = "scale_up"


class Signal(StrEnum):
    """What kind of trouble a stage's breach is evidence of; it decides between `scale_up` and `limited`
    (analysis/pillars/rules.py says which)."""

    LATENCY = "latency"  # over the SLO with no queue
    QUEUE_LATENCY = "queue_latency"  # over the SLO while requests queued: it grows with the queue
    RESOURCE = "resource"  # KV at its limit, sustained waiting, preemptions, GPU memory, an OOM
    ERRORS = "errors"  # failed requests, attributed by layer
    STABILITY = "stability"  # the server went down without memory evidence
    HEALTH_FLAP = "health_flap"  # /health said down while requests kept being answered


# The one check the harness writes about itself: an answer it could not judge (an exception while assembling,
# validating or recording it; k3load.workload.harness_error). Its layer is CLIENT; the analysis counts such an
# answer neither as valid nor as the server's failure, and says "inconclusive, because ..." while any exist.
HARNESS_ERROR: Final = "harness.error"
