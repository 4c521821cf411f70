"""The words every judgment is told in: a rule's or pillar's status, and the layer a failure is blamed on.

Why one place: the precheck's rules, the pillars and the verdict all write `status`, and validation,
the pillars and the reports all read `layer`; spelled in one module, a new status or layer is added
once and a typo is an ImportError, not a rule that silently never matches. (An attempt's own outcome,
`ok`/`http_error`/`timeout`/..., is the client's: `k3load.client.result.STATUSES`.)
"""

from __future__ import annotations

from typing import Final

# A rule's or a pillar's status. NOT_RUN: a pillar whose stages never ran; NOT_APPLICABLE: a precheck
# rule the deployment gives no occasion for (say, a custom-build record on a stock image).
PASS: Final = "pass"
FAIL: Final = "fail"
INCONCLUSIVE: Final = "inconclusive"
NOT_RUN: Final = "not_run"
NOT_APPLICABLE: Final = "not_applicable"

# Who is to blame for a failed attempt, upstream first: the model's output, vLLM's tool/reasoning
# parser, the vLLM server itself (its own JSON error bodies, its context-length refusal), a gateway or
# proxy in front of it (HTML pages, 502/503/504, 429 with Retry-After, resets, cut streams), our client.
MODEL_OUTPUT: Final = "model_output"
PARSER: Final = "parser"
SERVER: Final = "server"
GATEWAY: Final = "gateway"
CLIENT: Final = "client"
LAYERS: Final = (MODEL_OUTPUT, PARSER, SERVER, GATEWAY, CLIENT)

# The one check the harness writes about itself: an answer it could not judge (an exception while assembling,
# validating or recording it; k3load.workload.harness_error). Its layer is CLIENT; the analysis counts such an
# answer neither as valid nor as the server's failure, and says "inconclusive, because ..." while any exist.
HARNESS_ERROR: Final = "harness.error"
