"""The streaming-equivalence drill and the stall rule through the library (no Locust), against the real
sim on loopback: healthy twins agree; the sim's streaming-only faults make the streamed twin the
parser's; a call held back longer than the turn's deadline is a stall, a short drill deadline is not."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from k3load.client.chat import ChatClient
from k3load.workload.conversation import RunContext, StreamDrill, run_turn, run_turn_both_ways
from k3load.workload.scenario import Scenario, Turn, load_scenario
from k3load.workload.stream_equivalence import SAME

PARALLEL = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "agent_parallel_weather.yaml")
FIRST_CALL = PARALLEL.turns[0]  # two get_current_weather calls in one answer


def _ctx(**kw: object) -> RunContext:
    return RunContext(run_id="drill", model="tiny", user_id="u1", drill=StreamDrill(share=1.0), **kw)


def _both_ways(base_url: str, scenario: Scenario = PARALLEL, turn: Turn = FIRST_CALL) -> list:
    records: list = []
    with ChatClient(base_url) as client:
        run_turn_both_ways(client, _ctx(), scenario, turn, "", records.append)
    return records


def test_healthy_twins_agree_and_are_recorded_as_a_pair(sim):
    stream, whole = _both_ways(sim.base_url)
    assert (stream.stream_role, whole.stream_role) == ("stream", "whole") and stream.stream_pair == whole.stream_pair
    assert stream.stream and not whole.stream and stream.request_sha256 != whole.request_sha256
    assert stream.valid and whole.valid and len(stream.tool_calls) == 2
    found = next(f for f in stream.findings if f.check == "stream.equivalence")
    assert found.ok and found.detail == SAME
    assert stream.tool_call_deltas and stream.tool_call_max_gap_ms is not None and whole.tool_call_deltas is None


def test_streamed_empty_calls_and_a_dropped_call_are_the_streaming_paths_parser(start_sim):
    for fault in (["--stream-empty-tool-calls-rate", "1"], ["--parallel-call-drop-rate", "1"]):
        stream, whole = _both_ways(start_sim(*fault).base_url)
        assert whole.valid, (fault, whole.findings)
        assert stream.primary_layer == "parser", (fault, stream.findings)
        lost = next(f for f in stream.findings if f.check == "stream.equivalence")
        assert not lost.ok and lost.layer == "parser" and "non-streamed answer to the same request is right" in \
            lost.detail, fault


def test_a_call_held_back_past_the_deadline_is_a_stall_and_a_short_drill_deadline_is_not(start_sim):
    sim = start_sim("--tool-args-burst-rate", "1", "--tool-args-burst-ms", "30000")  # 3 s at time-scale 0.1
    short = replace(FIRST_CALL, settings={**FIRST_CALL.settings, "timeout_s": 1.5,
                                          "retry": {**FIRST_CALL.retry, "max_attempts": 1}})
    records: list = []
    with ChatClient(sim.base_url) as client:
        run_turn(client, _ctx(max_tool_call_gap_ms=1000.0), PARALLEL, short, "", records.append)
        (stalled,) = records
        assert stalled.status == "timeout" and stalled.last_silence_ms >= 1000
        assert [(f.check, f.layer) for f in stalled.findings if not f.ok] == [("stream.stall", "parser")]
        records.clear()
        run_turn(client, _ctx(max_tool_call_gap_ms=5000.0), PARALLEL, short, "", records.append)
        (cut,) = records  # the same silence under a limit longer than our deadline: our own timeout
        assert [(f.check, f.layer) for f in cut.findings if not f.ok] == [("transport", "client")]
