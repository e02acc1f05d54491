"""Prometheus metrics (contract section 7). No per-session labels: cardinality stays bounded.

Under `run --processes N` each child writes its metrics to PROMETHEUS_MULTIPROC_DIR and the
supervisor serves them together (prometheus-client's multiprocess mode). Counters and
histograms are summed over the children; each gauge says how (ignored in a single process):
queue gauges, which every child samples alike, report the latest sample of a live child;
in-flight is the sum over live children; ready is one series per live child (``pid`` label),
which is how the supervisor knows that every child is ready.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.messages = Counter(
            "dialog_messages", "Messages by final outcome", ["outcome"], registry=r
        )
        self.retries = Counter(
            "dialog_retries",
            "Messages that waited: contended = queued behind the session's holder at intake, "
            "error = released for a retry after a failed attempt",
            ["reason"],
            registry=r,
        )
        self.lock_contended = Counter(
            "dialog_lock_contended",
            "Messages that arrived while their session was held by a worker",
            registry=r,
        )
        self.reclaimed = Counter(
            "dialog_reclaimed",
            "Sessions taken over after their holder's lease ran out, and entries left pending",
            registry=r,
        )
        self.fencing_rejections = Counter(
            "dialog_fencing_rejections",
            "Commits refused because the lock or the state version moved on",
            registry=r,
        )
        self.topology_refreshes = Counter(
            "dialog_redis_topology_refreshes",
            "Times a Redis Cluster client learnt the slot map anew (start, failover, MOVED)",
            registry=r,
        )
        self.lease_renewals = Counter(
            "dialog_lease_renewals",
            "Worker lease renewals (one per shard an interval) and lock extensions of long steps",
            registry=r,
        )
        self.interrupts = Counter(
            "dialog_interrupts",
            "Attempts that ended waiting for a person (dialog_worker.interrupt)",
            registry=r,
        )
        self.journal_calls = Counter(
            "dialog_journal_calls",
            "once() calls: recorded = the function ran and its result was recorded, "
            "replayed = answered from the message's journal without calling it",
            ["result"],
            registry=r,
        )
        self.handoffs = Counter(
            "dialog_handoffs",
            "Messages handed straight to the lock holder by its previous commit",
            registry=r,
        )
        self.dispatches = Counter(
            "dialog_dispatches",
            "Slots freed by a commit and given, in the same call, to a session waiting in a "
            "tenant's queue",
            registry=r,
        )
        # Unread inbound entries removed by something other than a worker (MAXLEN, MINID,
        # XTRIM, XDEL), and a stream whose last id was pushed ahead (see lua/intake-5.lua).
        self.inbound_trimmed = Counter(
            "dialog_inbound_trimmed", "Unread inbound entries lost to trimming or XDEL", registry=r
        )
        self.inbound_id_ahead = Counter(
            "dialog_inbound_id_ahead", "Inbound stream found with its last id ahead", registry=r
        )
        # Inbound traceparent / tracestate fields that are not W3C Trace Context (counted
        # while tracing is on; the message goes on without them: dialog_worker/tracing.py).
        self.trace_context_invalid = Counter(
            "dialog_trace_context_invalid",
            "Inbound messages whose traceparent or tracestate field was malformed (ignored)",
            registry=r,
        )
        self.processing = Histogram(
            "dialog_processing_seconds",
            "From start of processing to commit, per message",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.end_to_end = Histogram(
            "dialog_end_to_end_seconds",
            "From first enqueue to commit, per message",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Queue-level gauges, per inbound stream shard (shard="0" with one stream).

        def queue_gauge(name: str, documentation: str) -> Gauge:
            return Gauge(
                name, documentation, ["shard"], registry=r, multiprocess_mode="livemostrecent"
            )

        self.stream_length = queue_gauge("dialog_stream_length", "XLEN of the inbound stream")
        self.group_lag = queue_gauge("dialog_group_lag", "Entries not yet read by the group")
        self.pending = queue_gauge("dialog_pending", "Entries read but not acked")
        self.oldest_pending_age = queue_gauge(
            "dialog_oldest_pending_age_seconds",
            "Age of the oldest unfinished message (the first entry of the inbound stream)",
        )
        self.delayed = queue_gauge(
            "dialog_delayed", "Sessions with messages outstanding (the ready set)"
        )
        self.dlq_length = queue_gauge("dialog_dlq_length", "XLEN of the dead-letter stream")
        self.sessions_queued = queue_gauge(
            "dialog_sessions_queued",
            "Sessions waiting in the tenants' queues for a slot (read ahead while tenants are "
            "in use)",
        )
        self.in_flight = Gauge(
            "dialog_in_flight",
            "Messages being processed here",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.reply_group_lag = Gauge(
            "dialog_reply_group_lag_ratio",
            "Unread reply events of a consumer group on the reply stream, as a share of "
            "DIALOG_REPLY_MAXLEN (at 1 the trim starts dropping events it has not read)",
            ["shard", "group"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.loop_lag = Histogram(
            "dialog_event_loop_lag_seconds",
            "How late a 100 ms timer fires on the worker's event loop (blocking code shows here)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.ready = Gauge(
            "dialog_ready",
            "1 while this worker reaches Redis and its group (as /readyz)",
            registry=r,
            multiprocess_mode="liveall",
        )
        # Redis as it runs (dialog_worker/store/checks.py).
        self.redis_eviction_unsafe = Gauge(
            "dialog_redis_eviction_unsafe",
            "1 while Redis has maxmemory with a policy other than noeviction (it can evict "
            "streams, locks and states); the worker is not ready then unless "
            "DIALOG_ALLOW_EVICTION=1",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.redis_oom = Counter(
            "dialog_redis_oom",
            "Calls Redis refused because it was out of memory (maxmemory reached), by "
            "operation; each is retried with backoff, never counted as an attempt",
            ["op"],
            registry=r,
        )
        self.redis_oom_active = Gauge(
            "dialog_redis_oom_backoff",
            "1 while this worker is backing off because Redis is out of memory",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.redis_switches = Counter(
            "dialog_redis_switches",
            "Times the Redis server behind REDIS_URL changed under this worker (its run_id: "
            "a failover or a restart)",
            registry=r,
        )
        self.commits_lost = Counter(
            "dialog_redis_commits_lost",
            "Commits of this worker that Redis acknowledged and no longer had after it "
            "changed (failover, or a restart that lost the end of its AOF)",
            registry=r,
        )
        # Model calls (dialog_worker/daemon/model_gate.py): labelled by model or limit key,
        # never by session or tenant.
        self.llm_tokens = Counter(
            "dialog_llm_tokens",
            "Tokens model calls reported using (committed or not), by model and kind "
            "(input, output)",
            ["model", "kind"],
            registry=r,
        )
        self.llm_calls = Counter(
            "dialog_llm_calls", "Model calls that went through a limit key", ["key"], registry=r
        )
        self.llm_rate_limited = Counter(
            "dialog_llm_rate_limited",
            "Provider 429s (RateLimited) by limit key: each paused its key for every worker",
            ["key"],
            registry=r,
        )
        self.llm_deferred = Counter(
            "dialog_llm_deferred",
            "Messages handed back to their turn to wait for a limit key (no attempt spent), by "
            "key and why (rpm, tpm, paused, in_flight, reserved)",
            ["key", "why"],
            registry=r,
        )
        for outcome in (
            "applied",
            "duplicate",
            "dead_lettered",
            "cancelled",
            "rejected",
            "superseded",
            "expired",
            "budget_exceeded",
            "merged",
        ):
            self.messages.labels(outcome)
        for reason in ("contended", "out_of_order", "error", "rate_limited"):
            self.retries.labels(reason)

    def queue_gauges(self) -> tuple[Gauge, ...]:
        return (
            self.stream_length,
            self.group_lag,
            self.pending,
            self.oldest_pending_age,
            self.delayed,
            self.dlq_length,
            self.sessions_queued,
        )
