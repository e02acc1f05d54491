"""Prometheus metrics (contract section 7). No per-session labels: cardinality stays bounded."""

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
            "dialog_retries", "Messages re-queued, by reason", ["reason"], registry=r
        )
        self.lock_contended = Counter(
            "dialog_lock_contended", "Acquisitions that found the session locked", registry=r
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
        self.lease_renewals = Counter(
            "dialog_lease_renewals", "Lock lease extensions of long steps", registry=r
        )
        self.handoffs = Counter(
            "dialog_handoffs",
            "Messages handed straight to the lock holder by its previous commit",
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
        shard = ["shard"]
        self.stream_length = Gauge(
            "dialog_stream_length", "XLEN of the inbound stream", shard, registry=r
        )
        self.group_lag = Gauge(
            "dialog_group_lag", "Entries not yet read by the group", shard, registry=r
        )
        self.pending = Gauge("dialog_pending", "Entries read but not acked", shard, registry=r)
        self.oldest_pending_age = Gauge(
            "dialog_oldest_pending_age_seconds",
            "Age of the oldest pending entry (since it entered the stream)",
            shard,
            registry=r,
        )
        self.delayed = Gauge(
            "dialog_delayed",
            "Sessions with messages outstanding (the ready set)",
            shard,
            registry=r,
        )
        self.dlq_length = Gauge(
            "dialog_dlq_length", "XLEN of the dead-letter stream", shard, registry=r
        )
        self.reply_group_lag = Gauge(
            "dialog_reply_group_lag_ratio",
            "Unread reply events of a consumer group on the reply stream, as a share of "
            "DIALOG_REPLY_MAXLEN (at 1 the trim starts dropping events it has not read)",
            ["shard", "group"],
            registry=r,
        )
        self.in_flight = Gauge("dialog_in_flight", "Messages being processed here", registry=r)
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
        )
        for outcome in ("applied", "duplicate", "dead_lettered"):
            self.messages.labels(outcome)
        for reason in ("contended", "out_of_order", "error"):
            self.retries.labels(reason)

    def queue_gauges(self) -> tuple[Gauge, ...]:
        return (
            self.stream_length,
            self.group_lag,
            self.pending,
            self.oldest_pending_age,
            self.delayed,
            self.dlq_length,
        )
