"""`dialog-worker` command line. JSON on stdout, one object per line; errors on stderr.
Exit codes: 0 ok, 1 failure, 2 usage or configuration error."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import redis.exceptions

from worker import bench
from worker.client import DEFAULT_CLAIM_IDLE_MS, DialogClient
from worker.config import Settings, load_settings
from worker.errors import ConfigError, ReplyStreamError, ReplyTimeout, ValidationError
from worker.keys import Keys

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _emit(obj: Any) -> None:
    print(json.dumps(obj, ensure_ascii=False), flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dialog-worker", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the worker daemon")
    run.add_argument("--concurrency", type=int)
    run.add_argument("--consumer")

    send = sub.add_parser("send", help="enqueue one message")
    send.add_argument("session")
    send.add_argument("text")
    send.add_argument("--msg-id")

    ask = sub.add_parser(
        "ask",
        help="send one message and print its reply event (exit 1 if it was dead-lettered "
        "or no reply came in time)",
    )
    ask.add_argument("session", help="session id")
    ask.add_argument("text", help="the user's message")
    ask.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the reply (default 30); on timeout, ask again with the same "
        "--msg-id to keep waiting (a seen msg_id is never applied twice)",
    )
    ask.add_argument("--msg-id", help="message id (default: a new random one)")

    replies = sub.add_parser(
        "replies",
        help="print reply events of every shard, one JSON line each (with --group: through a "
        "consumer group, acknowledging each event once printed)",
    )
    replies.add_argument(
        "--group",
        help="read through this consumer group (created if missing): each event goes to one "
        "reader of the group and is acknowledged once printed",
    )
    replies.add_argument(
        "--consumer", help="consumer name within --group (default: DIALOG_CONSUMER, hostname-pid)"
    )
    replies.add_argument(
        "--follow",
        action="store_true",
        help="keep waiting for new events until interrupted (Ctrl-C or SIGTERM)",
    )
    replies.add_argument(
        "--since",
        help="event id to start after: 0 = the oldest kept, $ = only new ones (default: 0, "
        "but $ for --follow without --group); with --group it only applies when the group "
        "is created",
    )
    replies.add_argument("--limit", type=int, help="stop after this many events")
    replies.add_argument(
        "--claim-idle-ms",
        type=int,
        default=DEFAULT_CLAIM_IDLE_MS,
        help="with --group: take over events another consumer left unacknowledged this long "
        f"(default {DEFAULT_CLAIM_IDLE_MS})",
    )

    state = sub.add_parser("state", help="print a session's dialog state (or null)")
    state.add_argument("session")

    session = sub.add_parser("session", help="inspect one session: lock, seqs, waiting messages")
    session.add_argument("session")
    session.add_argument(
        "--release-lock",
        action="store_true",
        help="delete the session lock (needs --yes); the holder's late "
        "commit is then refused by the fence",
    )
    session.add_argument("--yes", action="store_true", help="confirm --release-lock")

    stats = sub.add_parser("stats", help="queue statistics (all shards, or --shard N)")
    stats.add_argument("--format", choices=["json", "table"], default="json")
    stats.add_argument("--shard", type=int)

    dlq = sub.add_parser("dlq", help="dead-letter stream: list, show, redrive, purge")
    dlq.add_argument("--shard", type=int, help="only this shard (default: all)")
    dsub = dlq.add_subparsers(dest="dlq_command", required=True)
    dlist = dsub.add_parser("list", help="one line per dead letter, oldest first")
    dlist.add_argument("--limit", type=int, default=100)
    dshow = dsub.add_parser("show", help="every field of one dead letter")
    dshow.add_argument("id")
    dre = dsub.add_parser("redrive", help="re-send dead letters through send")
    dre.add_argument("--limit", type=int)
    dre.add_argument("--rate", type=float, help="at most this many per second")
    dre.add_argument("--id", dest="entry_id")
    dpurge = dsub.add_parser("purge", help="delete dead letters (all, or --id)")
    dpurge.add_argument("--id", dest="entry_id")

    reshard = sub.add_parser(
        "reshard", help="offline: move a drained deployment from DIALOG_SHARDS to --to N shards"
    )
    reshard.add_argument("--to", type=int, required=True, dest="to_shards")
    reshard.add_argument("--dry-run", action="store_true")

    verify = sub.add_parser("verify", help="concurrency verification against running workers")
    verify.add_argument("--sessions", type=int, default=50)
    verify.add_argument("--burst", type=int, default=10)
    verify.add_argument("--timeout", type=float, default=120.0)
    bench.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides: dict[str, Any] = {}
    if args.command == "run":
        overrides = {"concurrency": args.concurrency, "consumer": args.consumer}
    try:
        settings = load_settings(overrides)
    except ConfigError as exc:
        print(f"dialog-worker: invalid setting {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "run":
        return _run(settings)
    handler = _COMMANDS[args.command]
    try:
        return int(anyio.run(handler, settings, args))
    except ValidationError as exc:
        print(f"dialog-worker: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
        print(
            f"dialog-worker: redis error at {settings.redacted_url()}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return EXIT_FAILURE


def _run(settings: Settings) -> int:
    from worker.daemon import run_worker
    from worker.embedded import ensure_local_redis
    from worker.engine import load_engine
    from worker.log import configure

    configure(settings.log_level, settings.log_format, settings.consumer)
    try:
        engine = load_engine(settings.engine or None, settings.rules_file or None)
    except ConfigError as exc:
        print(f"dialog-worker: invalid setting {exc}", file=sys.stderr)
        return EXIT_USAGE
    embedded = None
    if "REDIS_URL" not in os.environ and settings.redis_url == "redis://localhost:6379/0":
        try:
            embedded = ensure_local_redis()
        except RuntimeError as exc:
            print(f"dialog-worker: {exc}", file=sys.stderr)
            return EXIT_FAILURE
    try:
        run_worker(settings, engine)
    finally:
        if embedded is not None:
            embedded.terminate()
            embedded.wait(timeout=10)
    return EXIT_OK


async def _send(settings: Settings, args: argparse.Namespace) -> int:
    async with DialogClient(settings=settings) as c:
        r = await c.send(args.session, args.text, msg_id=args.msg_id)
    _emit(r.as_dict())
    return EXIT_OK


async def _ask(settings: Settings, args: argparse.Namespace) -> int:
    async with DialogClient(settings=settings) as c:
        try:
            reply = await c.ask(args.session, args.text, msg_id=args.msg_id, timeout=args.timeout)
        except (ReplyTimeout, ReplyStreamError) as exc:
            print(f"dialog-worker: {exc}", file=sys.stderr)
            return EXIT_FAILURE
    _emit(reply.as_dict())
    return EXIT_FAILURE if reply.outcome == "dead_lettered" else EXIT_OK


async def _replies(settings: Settings, args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise ValidationError("--limit must be a positive integer")
    since = args.since or ("$" if args.follow and args.group is None else "0")
    async with DialogClient(settings=settings) as c:
        subscription = c.replies(
            args.group,
            args.consumer,
            start=since,
            follow=args.follow,
            claim_idle_ms=args.claim_idle_ms,
        )
        async with anyio.create_task_group() as tg:
            # Ctrl-C or SIGTERM ends a --follow cleanly (exit 0); an event printed but not
            # yet acknowledged is delivered again, which a group's readers must expect anyway.
            tg.start_soon(_cancel_on_signal, tg.cancel_scope)
            try:
                printed = 0
                async for reply in subscription:
                    _emit(reply.as_dict())
                    if reply.group is not None:
                        await c.ack(reply)
                    printed += 1
                    if args.limit is not None and printed >= args.limit:
                        break
            except ReplyStreamError as exc:
                print(f"dialog-worker: {exc}", file=sys.stderr)
                return EXIT_FAILURE
            finally:
                await subscription.aclose()
                tg.cancel_scope.cancel()
    return EXIT_OK


async def _cancel_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return


async def _state(settings: Settings, args: argparse.Namespace) -> int:
    async with DialogClient(settings=settings) as c:
        _emit(await c.state(args.session))
    return EXIT_OK


async def _session(settings: Settings, args: argparse.Namespace) -> int:
    from worker.codec import check_id
    from worker.views import session_view

    check_id("session_id", args.session)
    if args.release_lock and not args.yes:
        raise ValidationError("--release-lock deletes another worker's lock: add --yes")
    async with DialogClient(settings=settings) as c:
        keys = c.keys_for(args.session)
        view = await session_view(c.redis, keys, args.session)
        if args.release_lock:
            released = await c.redis.delete(keys.session(args.session).lock)
            view["lock_released"] = bool(released)
        _emit(view)
    return EXIT_OK


async def _stats(settings: Settings, args: argparse.Namespace) -> int:
    from worker.views import aggregate_stats

    async with DialogClient(settings=settings) as c:
        stats = await aggregate_stats(c.redis, _shards(c, args))
    if args.format == "table":
        width = max(len(k) for k in stats)
        for key, value in stats.items():
            if key != "shards":
                print(f"{key:<{width}}  {value}")
    else:
        _emit(stats)
    return EXIT_OK


async def _verify(settings: Settings, args: argparse.Namespace) -> int:
    from worker.verify import verify

    async with DialogClient(settings=settings, max_connections=200) as c:
        report = await verify(c, args.sessions, args.burst, args.timeout)
    _emit(report.as_dict())
    return EXIT_OK if report.ok else EXIT_FAILURE


async def _dlq(settings: Settings, args: argparse.Namespace) -> int:
    from worker import dlq

    async with DialogClient(settings=settings) as c:
        if args.dlq_command == "list":
            for row in await dlq.list_entries(_shards(c, args), c, args.limit):
                _emit(row)
        elif args.dlq_command == "show":
            entry = await dlq.show(_shards(c, args), c, args.id)
            if entry is None:
                print(f"dialog-worker: no dead letter {args.id}", file=sys.stderr)
                return EXIT_FAILURE
            _emit(entry)
        elif args.dlq_command == "redrive":
            if args.rate is not None and args.rate <= 0:
                raise ValidationError("--rate must be positive")
            _emit(await dlq.redrive(_shards(c, args), c, args.limit, args.rate, args.entry_id))
        else:
            _emit({"purged": await dlq.purge(_shards(c, args), c, args.entry_id)})
    return EXIT_OK


def _shards(client: DialogClient, args: argparse.Namespace) -> list[Keys]:
    """Every shard, or the one named by --shard."""
    if getattr(args, "shard", None) is None:
        return list(client.topology.shards)
    try:
        return [client.topology.shard(args.shard)]
    except IndexError as exc:
        raise ValidationError(str(exc)) from None


async def _reshard(settings: Settings, args: argparse.Namespace) -> int:
    from worker.reshard import NotDrained, reshard

    try:
        target = settings.replace(shards=args.to_shards)
    except ConfigError as exc:
        raise ValidationError(f"--to: {exc.problem}") from None
    async with DialogClient(settings=settings) as c:
        try:
            report = await reshard(c.redis, settings, target, dry_run=args.dry_run)
        except NotDrained as exc:
            print(
                f"dialog-worker: {exc}; stop producers and let the workers drain first",
                file=sys.stderr,
            )
            return EXIT_FAILURE
    _emit({"from_shards": settings.shards, "to_shards": target.shards, **report.as_dict()})
    return EXIT_OK


_COMMANDS: dict[str, Callable[[Settings, argparse.Namespace], Awaitable[int]]] = {
    "send": _send,
    "ask": _ask,
    "replies": _replies,
    "state": _state,
    "session": _session,
    "stats": _stats,
    "verify": _verify,
    "dlq": _dlq,
    "reshard": _reshard,
    "bench": bench.bench_command,
}
