"""Compare a streamed answer with its non-streamed twin (the streaming-equivalence drill).

Why a drill of its own: vLLM runs a different parser path for `stream: true` (incremental, stateful)
than for `stream: false` (one pass over the whole text), and Kimi's known tool-call failures live in
the streaming one (vllm#54701: under 6-14 concurrent streams the calls come back as empty deltas while
the identical whole request is right every time). Only the same request sent both ways at once can
tell the parser's streaming path from the model: both twins run the same model on the same prompt at
temperature 0.

What counts: a streamed answer that fails validation while its whole twin passes, and the two differ
the way a parser makes them differ (calls lost, added or renamed, another finish reason, or a
parser-layer finding on the streamed one: empty calls, unparsable or merged arguments, markup), is a
`parser` failure of the streaming path. Answers that differ otherwise are not: batched kernels are not
bit-exact, so a real server at temperature 0 may still pick another token under load; both valid,
only values differing, or the whole twin the wrong one are each counted apart.
"""

from __future__ import annotations

from typing import Any

from k3load.client.result import STATUS_OK, StreamResult
from k3load.outcomes import HARNESS_ERROR
from k3load.records import Finding
from k3load.workload import strict_json

CHECK = "stream.equivalence"
# The details of passing comparisons, read back by the analysis (rules as data, never by wording).
SAME, BOTH_VALID, WHOLE_WRONG, BOTH_WRONG, VALUES_WRONG, NOT_COMPARED = (
    "same", "differ, both valid", "differ, the non-streamed twin wrong", "differ, both wrong",
    "differ in values, the streamed one wrong", "not compared")
OUTCOMES = (SAME, BOTH_VALID, WHOLE_WRONG, BOTH_WRONG, VALUES_WRONG, NOT_COMPARED, "streaming path wrong")


def answer_shape(result: StreamResult) -> dict[str, Any]:
    """What must agree between the twins: the calls (names and parsed arguments, in order), the finish
    reason and the content. Arguments compare as parsed JSON (whitespace is not a difference); text
    that does not parse is kept as it is, so it differs from any parsed value."""
    calls = []
    for call in result.tool_calls:
        parsed = strict_json.parse(call.arguments or "")  # refused (deep, NaN, ...): compared as text
        arguments: Any = parsed.value if isinstance(parsed, strict_json.Parsed) else call.arguments
        calls.append({"name": call.name, "arguments": arguments})
    return {"tool_calls": calls, "finish_reason": result.finish_reason, "content": result.content.strip()}


def differences(stream: dict[str, Any], whole: dict[str, Any]) -> list[str]:
    """One short phrase per part that differs, streamed side first."""
    out = []
    s_calls, w_calls = stream["tool_calls"], whole["tool_calls"]
    if [c["name"] for c in s_calls] != [c["name"] for c in w_calls]:
        out.append(f"calls {[c['name'] for c in s_calls]} streamed vs {[c['name'] for c in w_calls]} whole")
    elif s_calls != w_calls:
        out.append("call arguments differ")
    if stream["finish_reason"] != whole["finish_reason"]:
        out.append(f"finish_reason {stream['finish_reason']!r} streamed vs {whole['finish_reason']!r} whole")
    if stream["content"] != whole["content"]:
        out.append("content differs")
    return out


def _structural(stream: dict[str, Any], whole: dict[str, Any]) -> bool:
    """A difference a parser makes (calls lost, added, renamed, or another finish), as opposed to other
    argument values or words, which a batch-variant kernel can make too."""
    names = [c["name"] for c in stream["tool_calls"]] != [c["name"] for c in whole["tool_calls"]]
    return names or stream["finish_reason"] != whole["finish_reason"]


def compare_twins(stream: StreamResult, stream_findings: list[Finding], whole: StreamResult,
                  whole_findings: list[Finding]) -> Finding:
    """The `stream.equivalence` finding of the streamed twin (its `detail` one of OUTCOMES when ok)."""
    unjudged = any(f.check == HARNESS_ERROR for f in (*stream_findings, *whole_findings))
    if stream.status != STATUS_OK or whole.status != STATUS_OK or unjudged:  # a twin the harness could not judge
        return Finding(CHECK, True, None, NOT_COMPARED)
    stream_shape, whole_shape = answer_shape(stream), answer_shape(whole)
    diff = differences(stream_shape, whole_shape)
    if not diff:
        return Finding(CHECK, True, None, SAME)
    stream_ok = all(f.ok for f in stream_findings)
    whole_ok = all(f.ok for f in whole_findings)
    structural = _structural(stream_shape, whole_shape) or \
        any(not f.ok and f.layer == "parser" for f in stream_findings)
    if whole_ok and not stream_ok and not structural:
        return Finding(CHECK, True, None, VALUES_WRONG)
    if whole_ok and not stream_ok:
        return Finding(CHECK, False, "parser", (
            f"the streamed answer is wrong where the non-streamed answer to the same request is right ("
            f"{'; '.join(diff)}): the parser's streaming path (vllm#54701)")[:500])
    return Finding(CHECK, True, None, BOTH_VALID if stream_ok and whole_ok else
                   WHOLE_WRONG if stream_ok else BOTH_WRONG)
