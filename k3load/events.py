"""The one catalogue of the run's seams: every events.jsonl event and every worker <-> master message.

Usage::

    from k3load.events import Event, Message
    log.event(Event.STAGE_START, stage=..., kind=..., users=..., mix=...)   # k3load.rundir.JsonlLog
    data.events_named(Event.SERVER_DOWN)                                     # k3load.analysis.run.rundata
    runner.send_message(Message.RECORD, line)                                # k3load.loadgen.worker

Why one place (as Locust's `locust.event.Events` names its hooks once): a name spelled in a writer and
again in a reader drifts apart silently, and a reader that looks for a name nobody writes just finds
nothing. `Event` and `Message` are `StrEnum`s, so a member is the plain string on disk and on the wire
(events.jsonl's bytes and the msgpack frames are the same as when they were bare strings), while a name
that is not here fails where it is written: the writers convert with `Event(name)`, which raises
ValueError. `FIELDS` and `MESSAGE_FIELDS` say what each one carries; tests/sim/test_event_catalogue.py checks
every line of a stored and of a fresh run against them, so a writer that adds an undeclared field fails.

events.jsonl — one JSON object per line, `{"ts": epoch s, "event": NAME, ...FIELDS[NAME]}`, appended and
flushed as it happens by the locust layer (k3load.loadgen) and the side sampler (k3load.sampler), which
share one writer during a run. `ts` is the run's clock (k3load.clock); the sampler's events carry the ts of
what they describe (e.g. a `server_down` the first failed poll's). The sampler's other files are described
in k3load/sampler/__init__.py.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol


class Event(StrEnum):
    """Every `event` an events.jsonl line can carry; what each one holds and who writes it: `FIELDS`."""

    # the locust layer: the run and its stages (k3load.loadgen)
    RUN_START = "run_start"
    STAGE_START = "stage_start"
    RUN_END = "run_end"
    HARNESS_ERROR = "harness_error"
    ANSWER_UNJUDGED = "answer_unjudged"
    TURN_FAILED = "turn_failed"
    LONG_INPUT_UNFIT = "long_input_unfit"
    PRECHECK = "precheck"
    DISK_SPACE_LOW = "disk_space_low"
    STAGE_DRAIN = "stage_drain"
    WORKER_SPOOLS = "worker_spools"
    WORKER_LOST = "worker_lost"
    LOAD_GENERATOR_CPU = "load_generator_cpu"
    RESTART_COMMAND = "restart_command"
    RESTART_DRILL_SKIPPED = "restart_drill_skipped"
    RECOVERY_HOLD = "recovery_hold"
    RESTART_DRILL_START = "restart_drill_start"
    RESTART_DRILL_DOWN = "restart_drill_down"
    RESTART_DRILL_READY = "restart_drill_ready"
    RESTART_DRILL_FAILED = "restart_drill_failed"
    SEARCH_STEP = "search_step"
    SEARCH_END = "search_end"
    REPLAY_END = "replay_end"
    # the side sampler (k3load.sampler)
    SAMPLER_START = "sampler_start"
    SAMPLER_STOP = "sampler_stop"
    SAMPLER_ERROR = "sampler_error"
    SERVER_DOWN = "server_down"
    SERVER_UP = "server_up"
    HEALTH_SLOW = "health_slow"
    COUNTER_RESET = "counter_reset"
    METRICS_MISSING = "metrics_missing"
    METRICS_BACK = "metrics_back"
    CACHE_CONFIG = "cache_config"
    VLLM_INFO = "vllm_info"
    PROMETHEUS_ERROR = "prometheus_error"
    PROMETHEUS_BACK = "prometheus_back"
    PROMETHEUS_INCOMPLETE = "prometheus_incomplete"
    GPU_FOUND = "gpu_found"
    GPU_UNAVAILABLE = "gpu_unavailable"
    GPU_SOURCE_DOWN = "gpu_source_down"
    GPU_SOURCE_UP = "gpu_source_up"
    REDIRECT = "redirect"
    LOG_OOM = "log_oom"
    LOG_NCCL = "log_nccl"
    LOG_CUDA_ERROR = "log_cuda_error"
    LOG_ENGINE_DEAD = "log_engine_dead"
    LOG_WARNING = "log_warning"
    LOG_TAIL_ENDED = "log_tail_ended"
    LOG_TAIL_ERROR = "log_tail_error"
    LOG_FLAGS_SUPPRESSED = "log_flags_suppressed"


def _f(*names: str) -> frozenset[str]:
    return frozenset(names)


_LOG_LINE = _f("source", "line")  # a flagged server log line (k3load.sampler.logtail.FLAGS), cut to 2,000 chars

# The fields each event may carry besides `ts` and `event`: the writer, then what the event means.
FIELDS: dict[Event, frozenset[str]] = {
    # k3load.loadgen.session, master/local: the run directory opened (previous_run_moved_to: where an earlier
    # run found there went, or null). k3load.rundir reads it back to name a run it sets aside.
    Event.RUN_START: _f("run_id", "role", "previous_run_moved_to"),
    # k3load.loadgen.session: a plan (or manual-N) stage begins; its window runs to the next one or run_end.
    # workers: the master's, None run alone; sessions_per_s: an open-loop stage's arrival rate (its `arrival`),
    # search: a search step's plan stage (both only where they apply)
    Event.STAGE_START: _f("stage", "kind", "users", "mix", "workers", "sessions_per_s", "search"),
    # k3load.loadgen.listeners.finish_run: the last records are in (attempts: written to records.jsonl.gz).
    # Without it the run was cut short.
    Event.RUN_END: _f("attempts"),
    # k3load.loadgen.session.fail: the run could not start (a dead server, a bad file); no verdict follows.
    Event.HARNESS_ERROR: _f("error"),
    # k3load.loadgen.console, local or master: an answer the harness could not judge (an exception of ours while
    # it was read, validated or recorded), recorded as received with a `harness.error` finding. Written at the
    # 1st, 10th, 100th ... of its kind in the process that sent it (kind: "RecursionError while validating the
    # answer (k3load/workload/validate.py:175 check_tool_calls)"; count: so far; first_attempt_id: the first of
    # its kind; attempt_id: this one; detail: its finding's; process: "ROLE PID"). A worker's are said on its
    # console only; the run's totals are in the records (k3load.summary, analysis/pillars/agent/unjudged.py).
    Event.ANSWER_UNJUDGED: _f("kind", "count", "first_attempt_id", "attempt_id", "detail", "process"),
    # k3load.loadgen.console, local or master: an exception left a turn with no record (the request could not be
    # built, the record could not be written); at the same counts as answer_unjudged (message: the exception's).
    Event.TURN_FAILED: _f("kind", "count", "message", "process"),
    # k3load.loadgen.session: a long-input scenario whose fixed part and answer budget exceed the server's
    # max_model_len; none of its requests are sent. Said once per scenario.
    Event.LONG_INPUT_UNFIT: _f("scenario", "fixed_tokens", "max_tokens", "max_model_len"),
    # k3load.loadgen.observe.precheck: compat.json's status before the first request, the failed rule ids, and
    # whether the load was skipped for it (status fail, the verdict rebuild, no --k3-load-after-rebuild).
    Event.PRECHECK: _f("status", "failed", "load_skipped"),
    # k3load.loadgen.observe.precheck: the run directory's filesystem has less free space than the plan may
    # write (k3load.disk_full.space_needed: bytes); the run goes on and stops if the disk fills.
    Event.DISK_SPACE_LOW: _f("free_bytes", "needed_bytes", "filesystem", "mount_point"),
    # k3load.loadgen.drain: one drain window after a plan stage. users_stopped_ts: every client had left;
    # drained: true / false / null (metrics missing); first, last: readings {ts, running, waiting, kv_usage,
    # generation_tokens, aborted}; error: only when there was no reading. k3load.analysis.pillars.headroom.drain_audit
    # judges it.
    Event.STAGE_DRAIN: _f("stage", "users_stopped_ts", "bound_s", "waited_s", "polls", "drained", "first", "last",
                          "error"),
    # k3load.loadgen.delivery.collect, master: each worker's account of its records (not_final: the workers
    # still short after the wait, named; by_worker: each worker's Tally).
    # k3load.loadgen.worker_count: the master's connected workers fell below the most seen this run (one died,
    # was evicted, lost its network); its users' load is lost from then on.
    Event.WORKER_LOST: _f("stage", "workers_before", "workers_now"),
    Event.WORKER_SPOOLS: _f("workers", "final", "not_final", "waited_s", "read_after_locust_quit", "by_worker"),
    # k3load.loadgen.cpu.write_reading, master: a worker's CPU per wall second (100 = one core), ts the
    # master's clock at receipt, worker_ts the worker's own. process: "worker HOST:PID". cpu_wait_pct: the share of
    # wall time it was ready to run and waited for a CPU (k3load.sampler.cpu_wait; null where unknown).
    Event.LOAD_GENERATOR_CPU: _f("process", "role", "worker", "cpu_pct", "cpu_wait_pct", "worker_ts"),
    # k3load.loadgen.observe.Restarter: after a server_down (not at the first poll) the --k3-restart-cmd
    # started (attempt: 1.., log: its output file in the run directory).
    Event.RESTART_COMMAND: _f("attempt", "pid", "log"),
    # k3load.loadgen.restart_drill: the restart stage was not drilled: the crash path restarted it already.
    Event.RESTART_DRILL_SKIPPED: _f("stage", "crash_restarts", "why"),
    # k3load.loadgen.recovery: a hold after a crash ended (the restart check's same conditions): the hold stage, the
    # crash stage whose users and mix it re-applied, the crash's server_down (ts, reason), the hold asked and the
    # time held, and how it ended: held, crashed_again (the crash recurred), run_ended (cut short).
    Event.RECOVERY_HOLD: _f("stage", "crash_stage", "down_ts", "down_reason", "users", "mix", "hold_s", "held_s",
                            "ended"),
    # k3load.loadgen.restart_drill: the restart command started on purpose (held_from: the stage whose load
    # the restart stage holds; up_before: the server answered before it).
    Event.RESTART_DRILL_START: _f("stage", "held_from", "users", "mix", "up_before", "log", "pid"),
    # k3load.loadgen.restart_drill: /health or /v1/models first failed, down_s after the start.
    Event.RESTART_DRILL_DOWN: _f("down_s"),
    # k3load.loadgen.restart_drill: both answered again within resources.max_restart_s.
    Event.RESTART_DRILL_READY: _f("time_to_ready_s", "down_seen", "command_rc"),
    # k3load.loadgen.restart_drill: it did not (why), or the server was never restarted.
    Event.RESTART_DRILL_FAILED: _f("why", "waited_s", "command_rc"),
    # k3load.loadgen.search_live, master/local: a step of a `kind: search` stage was decided (what the live search
    # decided; the analysis recomputes it from records and metrics). stage: the step's (NAME-sK-cUSERS), search:
    # the plan stage's NAME, step: K (repeats counted), goodput: the share of its requests that met every SLO,
    # goodput_ci95 [low, high] (Wilson), requests: chains counted, queue_share: scrapes with requests waiting
    # behind a full batch (k3load.analysis.pillars.headroom.full_batch; null without both gauges), past_capacity: that
    # queue, KV
    # or preemptions over their limits, kv_usage_max, decision: held | past_capacity | below_goodput |
    # near_bound (repeated once, then decided on both runs' evidence, which a repeat's fields hold),
    # duration_s: how long this run of the step went; waiting_sustained_s, preemptions_per_min, scheduled, late,
    # arrived, offered: the rest of what past_capacity read (turns with an intended time and those sent late,
    # sessions started and the rate times the seconds), so a step the judgment holds otherwise shows why.
    # A rate search's step (search_on: sessions_per_s): sessions_per_s its arrival rate, users its session slots.
    Event.SEARCH_STEP: _f("stage", "search", "users", "sessions_per_s", "step", "goodput", "goodput_ci95", "requests",
                          "queue_share", "past_capacity", "kv_usage_max", "decision", "duration_s",
                          "waiting_sustained_s", "preemptions_per_min", "scheduled", "late", "arrived", "offered"),
    # k3load.loadgen.search_live, master/local: the search stage NAME ended (largest_held_users, first_failed_users:
    # the bracket, null where none; a rate search's in largest_held_sessions_per_s, first_failed_sessions_per_s;
    # ended: resolved | max_users_held | max_rate_held | max_total_s | nothing_held | stopped; steps: how many
    # were decided).
    Event.SEARCH_END: _f("stage", "largest_held_users", "first_failed_users", "largest_held_sessions_per_s",
                         "first_failed_sessions_per_s", "ended", "steps"),
    # k3load.loadgen.replay (a worker's sent to its master as Message.REPLAY): a replay stage's rows in one
    # process at the stage's end (share "I of N": rows index mod N == I; rows_due, rows_sent, rows_late (over
    # 1 s), rows_not_played (not reached by the end), rows_in_flight_at_end (sent, still answering), rows_cut
    # (to fit max_model_len), worst_lag_s, users, in_flight_max; the blocks' sizing: tokenizer, tokens_per_word,
    # blocks_verified, verified_tokens_min/max, tokenize_calls; fell_behind: who and why, or null; min_tokens:
    # false once the server refused it, the later rows then asking max_tokens only; rows_short: answered rows
    # whose answer was shorter than the output_length asked, a server or gateway that did not honour min_tokens).
    Event.REPLAY_END: _f("stage", "trace", "speed", "block_tokens", "max_rows", "share", "share_note", "rows_due",
                         "rows_sent", "rows_late", "rows_not_played", "rows_in_flight_at_end", "rows_cut",
                         "worst_lag_s", "users", "in_flight_max", "tokenizer", "tokens_per_word", "blocks_verified",
                         "verified_tokens_min", "verified_tokens_max", "tokenize_calls", "fell_behind", "min_tokens",
                         "rows_short"),
    # k3load.sampler.loop: what samples what (URLs without credentials, api_key "set"|null, the log
    # command's program only, headers: their names only).
    Event.SAMPLER_START: _f("metrics_url", "metrics_urls", "health_url", "prometheus_url", "prometheus_selector",
                            "gpu_metrics_urls", "interval_s", "timeout_s", "nvml", "server_log",
                            "server_log_cmd_program", "api_key", "headers", "tls", "host", "pid"),
    # k3load.sampler.loop at stop: counts over the direct sources (sources: {source: {scrapes, failures}}),
    # prometheus {url, queries, query_failures, instances, lines, read_to_ts} | null, loop_errors {loop: n},
    # log_flags {kind: n} | null.
    Event.SAMPLER_STOP: _f("scrapes", "scrape_failures", "sources", "prometheus", "gpu_rows", "health_transitions",
                           "loop_errors", "log_lines", "log_flags"),
    # k3load.sampler.loop: a loop's tick raised (at most 20 per loop); the loop goes on.
    Event.SAMPLER_ERROR: _f("loop", "error"),
    # k3load.sampler.health: /health stopped answering. Refused, reset or an HTTP error (vLLM's 503): at the
    # first failed poll; polls that time out: only after 3 failed polls over >= 5 s, stamped with the first
    # failed poll's ts. first_poll: down from the sampler's first poll (not a crash seen happening). Counted
    # as a crash by the analysis; starts the crash path's restart command.
    Event.SERVER_DOWN: _f("source", "reason", "http_status", "first_poll", "failed_polls", "unanswered_s"),
    # k3load.sampler.health: /health answers again after a server_down (down_s: how long).
    Event.SERVER_UP: _f("source", "down_s"),
    # k3load.sampler.health: /health timed out, then answered before it counted as down (ts: the first slow
    # poll); not a crash, no restart.
    Event.HEALTH_SLOW: _f("source", "reason", "failed_polls", "unanswered_s"),
    # k3load.sampler.scrape (a /metrics source, or Prometheus as prometheus:<instance>): a counter went down or
    # the process start time moved on: the server restarted, deltas restart from zero.
    Event.COUNTER_RESET: _f("source", "series_down", "examples", "process_start_ts_before", "process_start_ts_after"),
    # k3load.sampler.scrape: the engine's gauges (k3load.sampler.prom.REQUIRED_SERIES) are absent (vLLM with
    # --disable-log-stats): said once per spell; those series are unknown, never zero.
    Event.METRICS_MISSING: _f("source", "reason", "absent", "vllm_series"),
    # k3load.sampler.scrape: they are back.
    Event.METRICS_BACK: _f("source", "vllm_series"),
    # k3load.sampler.scrape: vllm:cache_config_info's labels (one dict per engine: block size, KV capacity),
    # at the first scrape and when they change. Read by the cache pillar.
    Event.CACHE_CONFIG: _f("source", "family", "labels"),
    # k3load.sampler.scrape: another vllm:*_info gauge's labels, as cache_config.
    Event.VLLM_INFO: _f("source", "family", "labels"),
    # k3load.sampler.promapi: a query_range failed (source: the Prometheus URL); once per spell.
    Event.PROMETHEUS_ERROR: _f("source", "reason", "http_status"),
    # k3load.sampler.promapi: Prometheus answers again (down_reason: the spell's).
    Event.PROMETHEUS_BACK: _f("source", "down_reason"),
    # k3load.sampler.promapi at stop: the steps from unread_from_ts to unread_to_ts could not be read.
    Event.PROMETHEUS_INCOMPLETE: _f("source", "unread_from_ts", "unread_to_ts", "reason"),
    # k3load.sampler.gpu_poll: NVML found GPUs on this node (gpus: count, names: one per GPU).
    Event.GPU_FOUND: _f("source", "node", "gpus", "names"),
    # k3load.sampler.gpu_poll / scrape: no GPU telemetry from this source (said once); gpu.jsonl has no rows
    # from it, never zeros.
    Event.GPU_UNAVAILABLE: _f("source", "reason"),
    # k3load.sampler.gpu_poll: a dcgm-exporter stopped answering (once per spell) ...
    Event.GPU_SOURCE_DOWN: _f("source", "reason"),
    # ... and answers again.
    Event.GPU_SOURCE_UP: _f("source"),
    # k3load.sampler.loop: a GET of the sampler (/metrics, /health, dcgm, Prometheus; source: its URL without
    # credentials or query) was redirected to another origin or refused (k3load.sampler.fetch.Redirect):
    # action "credentials_dropped" (followed without the key and gateway headers), "followed" (none were
    # sent), "refused_downgrade" (https -> http), "refused_scheme" (not http(s)) or "not_followed" (a 3xx
    # urllib does not follow). Said once per source, to_origin (scheme://host:port) and action.
    Event.REDIRECT: _f("source", "to_origin", "http_status", "action"),
    # k3load.sampler.logtail: flagged server log lines (first matching flag wins; at most 100 per kind).
    Event.LOG_OOM: _LOG_LINE,  # CUDA out of memory: a crash cause for the resources pillar
    Event.LOG_NCCL: _LOG_LINE,  # NCCL warnings/errors, collective timeouts
    Event.LOG_CUDA_ERROR: _LOG_LINE,  # CUDA errors, illegal memory access, Xid, device asserts
    Event.LOG_ENGINE_DEAD: _LOG_LINE,  # EngineDeadError, the engine core died: a crash for the resources pillar
    Event.LOG_WARNING: _LOG_LINE,  # a WARNING/ERROR about kernels, attention backends, communication, fallbacks
    # k3load.sampler.logtail: the log command ended by itself (it is not restarted: it would replay old lines).
    Event.LOG_TAIL_ENDED: _f("source", "returncode"),
    # k3load.sampler.logtail: following the log failed; the sampler goes on without it.
    Event.LOG_TAIL_ERROR: _f("source", "error"),
    # k3load.sampler.logtail at stop: flagged lines past the per-kind cap, counted {kind: n}.
    Event.LOG_FLAGS_SUPPRESSED: _f("source", "counts"),
}


class EventSink(Protocol):
    """How the sampler's parts write an event: `sink(Event.SERVER_DOWN, ts, source=..., ...)` stamped with
    `ts` (k3load.sampler.loop.Sampler.event; tests pass a list's append wrapped in a function)."""

    def __call__(self, name: Event, ts: float, /, **fields: Any) -> None: ...


class Message(StrEnum):
    """Every Locust custom message between a worker and its master (`runner.send_message` /
    `register_message`); what each one carries: `MESSAGE_FIELDS`."""

    RUN = "k3_run"
    STAGE = "k3_stage"
    JOIN = "k3_join"
    RECORD = "k3_record"
    DONE = "k3_done"
    CPU = "k3_cpu"
    REFUSED = "k3_refused"
    REPLAY = "k3_replay"


# The keys of each message's data (msgpack): None where the data is not a dict.
MESSAGE_FIELDS: dict[Message, frozenset[str] | None] = {
    # master -> workers (k3load.loadgen.session.ensure_started): the run's identity; a worker joins it.
    Message.RUN: _f("run_id", "run_dir", "model", "max_model_len"),
    # master -> workers (k3load.loadgen.session.enter_stage): the shape entered stage `name`; `stage` is the
    # whole Stage (as a dict) for a manual stage, which is in no plan, else null; workers: the master's count of
    # connected workers then (a replay stage's rows are split by it: k3load.loadgen.replay.process_share).
    Message.STAGE: _f("name", "stage", "workers"),
    # worker -> master (k3load.loadgen.worker.WorkerLink.join): in this run; spool: its spool file's name or null.
    Message.JOIN: _f("run_id", "spool", "host", "pid"),
    # worker -> master (WorkerLink.send): one record, as the JSON line written to records.jsonl.gz.
    Message.RECORD: None,
    # worker -> master (WorkerLink.seal, at test_stop): its own count of records sent and not sent.
    Message.DONE: _f("run_id", "sent", "unsent", "spool"),
    # worker -> master (k3load.loadgen.cpu.CpuReporter): its CPU per wall second; written as load_generator_cpu.
    Message.CPU: _f("run_id", "cpu_pct", "cpu_wait_pct", "ts", "host", "pid"),
    # worker -> master (k3load.loadgen.listeners, at test_start): it does not hold the master's secrets for this
    # target (why: one line, no value); the master stops the run, exit 2.
    Message.REFUSED: _f("host", "pid", "why"),
    # worker -> master (k3load.loadgen.replay.event_writer, at a replay stage's end): its rows, as `replay_end`
    # carries them (FIELDS), and the run it belongs to; written by the master as that event.
    Message.REPLAY: _f("run_id", *FIELDS[Event.REPLAY_END]),
}
