"""Locust user classes, one per scenario family; each plays whole scenarios with its own client.

Why one class per family: the stage plan mixes families by weight (Locust's own user-class
weights), and the live view shows each family's TTFT / ITL / e2e as separate named entries.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

import gevent
from locust import User, constant, task
from locust.exception import InterruptTaskSet, RescheduleTask, RescheduleTaskImmediately, StopTest, StopUser

from k3load.client.chat import ChatClient
from k3load.loadgen import console
from k3load.loadgen.arrivals import Schedules
from k3load.loadgen.options import run_access
from k3load.loadgen.replay import Replays, ReplayState, Ticket, event_writer, process_share, server_count
from k3load.workload.conversation import RunContext, ScenarioPlay, StreamDrill
from k3load.workload.plan import Stage
from k3load.workload.trace import TraceError

if TYPE_CHECKING:  # the session is the environment's (k3load.loadgen.listeners): for the annotations only
    from k3load.loadgen.session import HarnessSession

_numbers = itertools.count(1)
DEAD_SERVER_PAUSE_S = 1.0
ERROR_PAUSE_S = 0.2
IDLE_PAUSE_S = 0.2
ARRIVAL_POLL_S = 0.5  # longest single wait for an open-loop session's turn (a stage change is seen by then)
# Locust's own control flow, raised through a task on purpose: never a harness error
LOCUST_FLOW = (InterruptTaskSet, RescheduleTask, RescheduleTaskImmediately, StopTest, StopUser)


class K3User(User):
    """Plays scenarios of `family` (those the stage plays: `HarnessSession.playable`); idles when the
    stage's per-user iteration budget is spent or when none of them can be played on this server."""

    abstract = True
    family: ClassVar[str] = ""
    wait_time = constant(0)

    def on_start(self) -> None:
        session = self.environment.k3_session
        session.wait_ready()
        opts = self.environment.parsed_options
        self.user_id = f"{self.family}-{os.getpid()}-{next(_numbers)}"
        secrets, tls = run_access(opts)
        self.chat = ChatClient(self.host or "", secrets=secrets, tls=tls, transport=opts.k3_transport,
                               max_body_bytes=opts.k3_max_body_bytes, max_line_bytes=opts.k3_max_line_bytes)
        self.rng = random.Random(f"{opts.k3_seed}:{self.user_id}")
        self.ctx = RunContext(run_id=session.run_id, model=session.model, user_id=self.user_id,
                              stage=lambda: session.stage_name, long_context=session.long_context,
                              sleep=gevent.sleep, max_tool_call_gap_ms=session.limits["agent_api"]
                              ["max_tool_call_gap_ms"], drill=self._drill(session, opts),
                              on_unjudged=console.harness_errors(self.environment).unjudged,
                              session_header=getattr(opts, "k3_session_header", "") or None)
        self.played: dict[str, int] = {}
        self.current: ScenarioPlay | None = None
        self.arrived_in: Stage | None = None  # the stage an open-loop session arrived in (None: closed-loop)
        self.pace = random.Random(f"{opts.k3_seed}:{self.user_id}:think")  # the agents' gaps between turns
        self.ticket: tuple[str, Ticket] | None = None  # a replay stage's row this user holds (stage name, row)
        self.free_since = 0.0  # when this user's last replayed row ended (0: it sent none yet)

    @task
    def play(self) -> None:
        """One turn per task, so a stage change or the end of the run stops a user between turns. No
        exception of ours reaches Locust's task runner (it would print a traceback per turn): an answer the
        turn could not judge is already recorded (k3load.workload.conversation); what still escapes (the
        request could not be built, the record could not be written) is counted and said by kind."""
        try:
            self._play()
        except LOCUST_FLOW:
            raise
        except Exception as exc:
            console.harness_errors(self.environment).turn_failed(exc)
            gevent.sleep(ERROR_PAUSE_S)  # a turn that fails at once must not spin

    def _play(self) -> None:
        session = self.environment.k3_session
        if session.fatal:  # a worker refusing the run, a master stopping it: not one more request
            gevent.sleep(IDLE_PAUSE_S)
            return
        stage = session.stage
        if stage is not None and stage.replay is not None:
            self._replay(session, stage)  # a production trace: its rows, not this family's scenarios
            return
        playable = session.playable(self.family)
        if self.current is not None and (self.current.scenario.name not in {s.name for s in playable}
                                         or not _goes_on(self.arrived_in, stage)):
            # the stage changed what this family plays (the control pairs end with it), or an open-loop
            # session's stage ended (it belongs to the stage it arrived in, or to its search)
            self.current = None
        if (self.current is None or self.current.done) and not self._next_play(session, stage, playable):
            gevent.sleep(IDLE_PAUSE_S)  # budget spent, nothing of this family fits the server, arrivals over
            return
        assert self.current is not None
        wait = self.current.due_in_s(time.time())
        if wait > 0:  # an open-loop session's arrival or its agent's gap: waited in slices, so a stage change shows
            gevent.sleep(min(wait, ARRIVAL_POLL_S))
            return
        attempts = self.current.step(session.record)
        if attempts and attempts[-1].status == "transport_error":
            gevent.sleep(DEAD_SERVER_PAUSE_S)  # the server is gone: probe it, don't spin on refused connections
        elif attempts and attempts[-1].status in ("http_error", "client_raised"):
            gevent.sleep(ERROR_PAUSE_S)  # an instant refusal (or our client's bug) would otherwise flood the records

    def _next_play(self, session: HarnessSession, stage: Stage | None, playable: list[Any]) -> bool:
        """The next scenario to play (an open-loop stage's: when its session arrives); False when there is none."""
        if not playable or self._budget_spent(stage):
            return False
        arrival_ts = self._arrival(stage)
        if arrival_ts is False:
            return False
        if stage is not None:
            self.played[stage.name] = self.played.get(stage.name, 0) + 1
        opened = isinstance(arrival_ts, float)
        self.current = ScenarioPlay(self.chat, self.ctx,
                                    self.rng.choice(playable), arrival_ts if opened else None,
                                    self.pace if opened else None)
        self.arrived_in = stage if opened else None
        return True

    def _arrival(self, stage: Stage | None) -> float | bool | None:
        """An open-loop stage's next session start for this user (k3load.loadgen.arrivals), False when its
        arrivals are over; None in a closed-loop stage. Each process takes its share of the rate: its users
        over the stage's (Locust splits a stage's users over the workers)."""
        if stage is None or stage.arrival is None:
            return None
        arrival = stage.arrival
        session = self.environment.k3_session
        schedules = getattr(self.environment, "k3_arrivals", None)
        if schedules is None or schedules.run_id != session.run_id:  # a new test (the web UI's next): new schedules
            schedules = self.environment.k3_arrivals = Schedules(self.environment.parsed_options.k3_seed,
                                                                 session.run_id)
        runner = self.environment.runner
        mine = getattr(runner, "target_user_count", 0) or stage.users
        share = replace(arrival, sessions_per_s=arrival.sessions_per_s * min(1.0, mine / stage.users))
        entered = time.time() - (time.monotonic() - session.stage_started)  # the schedule runs from the stage's entry
        ticket = schedules.of(stage.name, share, entered, stage.duration_s).take()
        return False if ticket is None else ticket

    def _replay(self, session: HarnessSession, stage: Stage) -> None:
        """One row of a replay stage (k3load.loadgen.replay): take the next, wait for its time in slices (a stage
        change shows), send it. A row held when its stage ended is not sent (counted as not played)."""
        state = self._replay_state(session, stage)
        if state is None:
            return
        if self.ticket is None or self.ticket[0] != stage.name:
            taken = state.take(time.time(), self.free_since)
            if taken is None:
                self.ticket = None
                gevent.sleep(IDLE_PAUSE_S)  # every row of this process taken (or none reached before the end)
                return
            self.ticket = (stage.name, taken)
        ticket = self.ticket[1]
        wait = ticket.due_ts - time.time()
        if wait > 0:
            gevent.sleep(min(wait, ARRIVAL_POLL_S))
            return
        self.ticket = None
        try:
            state.play(ticket, self.chat, self.ctx, session.record, session.model)
        finally:
            self.free_since = time.time()

    def _replay_state(self, session: HarnessSession, stage: Stage) -> ReplayState | None:
        """This process's schedule of the stage's rows, made by its first user from the stage's entry; a trace
        that can no longer be read (it was checked when the plan loaded) ends the run, said once."""
        replays = getattr(self.environment, "k3_replays", None)
        if replays is None or replays.run_id != session.run_id:  # a new test (the web UI's next): afresh
            replays = self.environment.k3_replays = Replays(session.run_id)
        entered = time.time() - (time.monotonic() - session.stage_started)
        try:
            share = process_share(self.environment.runner, self.environment.parsed_options, session.master_workers)
            return replays.of(stage, entered, share, server_count(session.target, session.model),
                              session.max_model_len, event_writer(session.events, self.environment.runner,
                                                                  session.run_id))
        except TraceError as exc:
            session.fail(str(exc))
            return None

    def _drill(self, session: HarnessSession, opts: Any) -> StreamDrill | None:
        """The plan's streaming-equivalence drill for this user, its twins in flight together."""
        drill = session.plan.stream_equivalence if session.plan else None
        if not drill:
            return None
        return StreamDrill(turns=tuple(drill["turns"]), share=drill["share"],
                           rng=random.Random(f"{opts.k3_seed}:{self.user_id}:stream-equivalence"),
                           concurrently=_concurrently)

    def _budget_spent(self, stage: Stage | None) -> bool:
        return stage is not None and stage.iterations_per_user is not None and \
            self.played.get(stage.name, 0) >= stage.iterations_per_user

    def on_stop(self) -> None:
        chat: Any = getattr(self, "chat", None)
        if chat is not None:
            chat.close()


def _goes_on(arrived_in: Stage | None, stage: Stage | None) -> bool:
    """An open-loop session goes on only in the stage it arrived in: a rate search's next step offers its own
    rate, not the last one's sessions still at work (a backlog carried over from a step past capacity would fail
    every step after it, however light); a closed-loop play (arrived in no stage) goes on as before."""
    return arrived_in is None or (stage is not None and stage.name == arrived_in.name)


def _concurrently(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
    """Both at once on this user's connection pool (the second in its own greenlet)."""
    other = gevent.spawn(second)
    try:
        mine = first()
    finally:
        other.join()
    return mine, other.get()


class AgentUser(K3User):
    family = "agent"


class SharedPrefixUser(K3User):
    family = "shared_prefix"


class ColdUser(K3User):
    family = "cold"


class LongInputUser(K3User):
    family = "long_input"


USER_CLASSES: dict[str, type[K3User]] = {c.family: c for c in (AgentUser, SharedPrefixUser, ColdUser, LongInputUser)}
