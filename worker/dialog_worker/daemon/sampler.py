"""The worker's gauges: the queue as Redis holds it (sampled, less often while idle) and how
late the event loop runs."""

from __future__ import annotations

import time

import anyio
from redis.asyncio import Redis

from dialog_worker.config import Settings
from dialog_worker.daemon.sessions import Sessions
from dialog_worker.daemon.shard import Shard
from dialog_worker.metrics import Metrics
from dialog_worker.store.queue_view import queue_stats, reply_group_lags

# While a worker's last sample saw an empty queue and it has started no message since, it
# samples the queue gauges every this many intervals.
IDLE_SAMPLE_EVERY = 3


class Sampler:
    def __init__(
        self,
        settings: Settings,
        redis: Redis,
        metrics: Metrics,
        shards: list[Shard],
        sessions: Sessions,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.metrics = metrics
        self.shards = shards
        self.sessions = sessions
        # The view of idleness: sessions started at the last sample, whether that sample saw
        # an empty queue, and the intervals skipped since.
        self._sampled_at_sessions = -1
        self._sampled_empty = False
        self._samples_skipped = 0

    async def watch_loop_lag(self) -> None:
        """The event loop must never be blocked for long (plain engine steps run in threads):
        measure how late a short timer fires."""
        interval = 0.1
        while True:
            started = time.perf_counter()
            await anyio.sleep(interval)
            self.metrics.loop_lag.observe(max(0.0, time.perf_counter() - started - interval))

    async def sample_once(self) -> float:
        """The queue gauges. An idle worker (its last sample saw nothing unread, waiting,
        delayed or pending, and it has started no message since) samples every
        IDLE_SAMPLE_EVERY intervals: an idle pool costs Redis little."""
        interval = self.settings.metrics_sample_interval_s
        if (
            self._sampled_empty
            and self.sessions.started == self._sampled_at_sessions
            and self._samples_skipped < IDLE_SAMPLE_EVERY - 1
        ):
            self._samples_skipped += 1
            return interval
        self._samples_skipped = 0
        self._sampled_at_sessions = self.sessions.started
        empty = True
        m = self.metrics
        for shard in self.shards:
            stats = await queue_stats(self.redis, shard.keys)
            label = shard.label
            m.stream_length.labels(label).set(stats["stream_length"])
            m.group_lag.labels(label).set(stats["lag"] or 0)
            m.pending.labels(label).set(stats["pending"])
            m.oldest_pending_age.labels(label).set(stats["oldest_pending_age_s"])
            m.delayed.labels(label).set(stats["delayed"])
            m.dlq_length.labels(label).set(stats["dlq_length"])
            m.sessions_queued.labels(label).set(stats["queued"])
            empty = empty and not (
                stats["stream_length"] or stats["pending"] or stats["delayed"] or stats["waiting"]
            )
            if self.settings.reply_maxlen:
                for group, lag in (await reply_group_lags(self.redis, shard.keys)).items():
                    m.reply_group_lag.labels(label, group).set(lag / self.settings.reply_maxlen)
        self._sampled_empty = empty
        return interval
