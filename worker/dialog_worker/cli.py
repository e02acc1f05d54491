"""`dialog-worker` command line. JSON on stdout, one object per line; errors on stderr.
Exit codes: 0 ok, 1 failure, 2 usage or configuration error."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import anyio
import redis.exceptions
import structlog

from dialog_worker import tracing
from dialog_worker.bench import command as bench
from dialog_worker.client.dialog_client import DEFAULT_CLAIM_IDLE_MS, DialogClient
from dialog_worker.config import (
    MAX_LIMIT_VALUE,
    MAX_TOKENS_A_DAY,
    Settings,
    decimal_number,
    embedded_redis_url,
    load_settings,
    redact_url,
    whole_number,
)
from dialog_worker.errors import (
    ConfigError,
    EngineHookError,
    ReplyStreamError,
    ReplyTimeout,
    ValidationError,
)
from dialog_worker.ops.dead_letters import duration_arg, handle_arg
from dialog_worker.store.keys import Keys
from dialog_worker.version import __version__

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
T = TypeVar("T")


def _emit(obj: Any) -> None:
    print(json.dumps(obj, ensure_ascii=False), flush=True)


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error format: one line on stderr, exit 2 (argparse's default
    prints the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        print(f"dialog-worker: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from a settings validator (dialog_worker/config.py): a flag takes
    exactly what the setting takes, and is refused in the setting's words."""

    def check(raw: str) -> T:
        try:
            return parse(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return check


_positive_int = _checked(lambda raw: whole_number(raw, 1))
# A limit key's rpm, tpm and max_in_flight: what DIALOG_MODEL_LIMITS takes.
_limit_value = _checked(lambda raw: whole_number(raw, 0, MAX_LIMIT_VALUE))
# A tenant's min, max and daily tokens: what DIALOG_TENANT_DAILY_TOKENS takes.
_tenant_count = _checked(lambda raw: whole_number(raw, 0, MAX_TOKENS_A_DAY))


def _above_zero(raw: str, maximum: float) -> float:
    value = decimal_number(raw, 0.0, maximum)
    if value == 0:
        raise ValueError(f"must be above 0 and at most {maximum:g}, got {raw!r}")
    return value


_seconds = _checked(lambda raw: _above_zero(raw, 7 * 86400))
_weight = _checked(lambda raw: _above_zero(raw, 1_000_000))


def _processes(raw: str) -> int:
    if raw == "auto":
        from dialog_worker.daemon.supervisor import cpu_count

        return cpu_count()
    return _positive_int(raw)


def _session_id(raw: str) -> str:
    """Refused here as well as by the client: a blank id names no conversation."""
    if not raw.strip():
        raise argparse.ArgumentTypeError("a session id must not be empty or blank")
    return raw


def _json_value(raw: str) -> object:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise argparse.ArgumentTypeError(
            f"not JSON (a string needs its quotes: '\"yes\"'): {raw!r}"
        ) from None


_STREAM_ID = re.compile(r"\d{1,20}(-\d{1,20})?")


def _entry_id(raw: str) -> str:
    if not _STREAM_ID.fullmatch(raw):
        raise argparse.ArgumentTypeError(f"not a stream entry id (like 1718000000000-0): {raw!r}")
    return raw


_EXPIRES_HELP = (
    "unix seconds: if the message's turn comes later, it ends expired without a step "
    "(one reply event)"
)


def _priority(raw: str) -> int:
    if len(raw) != 1 or not "0" <= raw <= "9":  # one ASCII digit, as intake reads it
        raise argparse.ArgumentTypeError(f"expected a whole number from 0 to 9, got {raw!r}")
    return int(raw)


def _tenant_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tenant",
        help="the customer the message belongs to (1-64 bytes, no spaces): slots, model-call "
        "turns and budgets are shared fairly between tenants (default: DIALOG_TENANT_PATTERN's "
        "group in the session id, else 'default')",
    )
    parser.add_argument(
        "--priority",
        type=_priority,
        help="0 to 9, higher first (default 5): where the session waits in its tenant's "
        "queue; never reorders one session's messages",
    )


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dialog-worker", description=__doc__)
    p.add_argument("--version", action="version", version=f"dialog-worker {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the worker daemon")
    run.add_argument(
        "--concurrency", type=_positive_int, help="messages in flight (DIALOG_CONCURRENCY)"
    )
    run.add_argument("--consumer", help="consumer name, unique per process (DIALOG_CONSUMER)")
    run.add_argument(
        "--processes",
        type=_processes,
        default=1,
        help="worker processes on this host under one supervisor that restarts them and "
        "serves one /metrics for all ('auto': one per CPU; default 1: no supervisor)",
    )

    send = sub.add_parser("send", help="enqueue one message")
    send.add_argument("session", type=_session_id, help="session id")
    send.add_argument("text", help="message text")
    send.add_argument(
        "--msg-id",
        help="idempotency key: a resend with the same one is answered as a duplicate "
        "(default: a new random one)",
    )
    send.add_argument("--expires-at", type=float, metavar="SECONDS", help=_EXPIRES_HELP)
    send.add_argument(
        "--deliver-at",
        type=float,
        help="seconds since the epoch: the message joins its session's order then, not now",
    )
    _tenant_arguments(send)

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
    ask.add_argument("--expires-at", type=float, metavar="SECONDS", help=_EXPIRES_HELP)
    ask.add_argument(
        "--stream",
        action="store_true",
        help="print the answer as it is written: one JSON line per event (delta, reset, "
        "resync), then the end event with the committed reply",
    )
    _tenant_arguments(ask)

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

    cancel = sub.add_parser(
        "cancel",
        help="cancel one message (waiting or running) and print what was found: "
        "cancelled, finished or pending",
    )
    cancel.add_argument("session", type=_session_id, help="session id")
    cancel.add_argument("msg_id", help="the message's msg_id")

    pending = sub.add_parser(
        "pending",
        help="print the interrupts a session waits on (a step asked a person: "
        "dialog_worker.interrupt), one JSON line each",
    )
    pending.add_argument("session", type=_session_id, help="session id")

    resume = sub.add_parser(
        "resume",
        help="answer a session's interrupt with a JSON value (applied once) and print the "
        "status: resumed, already_resumed, timed_out, cancelled or unknown",
    )
    resume.add_argument("session", type=_session_id, help="session id")
    resume.add_argument("interrupt_id", help="the interrupt's id (see pending)")
    resume.add_argument(
        "value", type=_json_value, help='the answer, as JSON: true, "yes", {"approved": true}'
    )

    state = sub.add_parser("state", help="print a session's dialog state (or null)")
    state.add_argument("session", type=_session_id, help="session id")

    token = sub.add_parser(
        "token",
        help="mint a session token for a browser (signed with DIALOG_HTTP_SIGNING_KEY) and "
        "print it with the session and its expiry",
    )
    token.add_argument("session", type=_session_id, help="session id")
    token.add_argument(
        "--ttl", type=float, default=3600, help="seconds until it expires (default 3600)"
    )
    token.add_argument(
        "--actions",
        default=None,
        help="comma-separated, some of send,stream,cancel,events,pending,resume (default: all)",
    )

    session = sub.add_parser(
        "session",
        help="inspect one session: lock, seqs, waiting messages (session SESSION); start it "
        "over (session reset SESSION --yes) or erase it (session delete SESSION --yes)",
    )
    session.add_argument(
        "session", type=_session_id, help="session id, or reset / delete followed by one"
    )
    session.add_argument(
        "target",
        nargs="?",
        type=_session_id,
        help="after reset: the session whose state goes back to the initial one (history "
        "cleared, waiting messages and timers kept); after delete: the session whose state, "
        "history, waiting messages, timers, dedupe keys, cancel marks, partial replies and "
        "dead letters are removed. Both refuse a running step's commit; both need --yes",
    )
    session.add_argument("--reason", default="", help="reset/delete: recorded in the audit stream")
    session.add_argument(
        "--purge-replies",
        action="store_true",
        help="delete: also remove the session's reply events (reads the whole reply stream)",
    )
    session.add_argument(
        "--release-lock",
        action="store_true",
        help="delete the session lock (needs --yes); the holder's late "
        "commit is then refused by the fence",
    )
    session.add_argument(
        "--yes", action="store_true", help="confirm --release-lock, reset or delete"
    )

    stats = sub.add_parser("stats", help="queue statistics (all shards, or --shard N)")
    stats.add_argument(
        "--format", choices=["json", "table"], default="json", help="output (default json)"
    )
    stats.add_argument("--shard", type=int, help="only this shard (default: all, summed)")

    dlq = sub.add_parser("dlq", help="dead-letter stream: list, show, redrive, purge")
    dlq.add_argument("--shard", type=int, help="only this shard (default: all)")
    dsub = dlq.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    dlist = dsub.add_parser("list", help="one line per dead letter, oldest first")
    dlist.add_argument(
        "--limit", type=_positive_int, default=100, help="at most this many (default 100)"
    )
    dshow = dsub.add_parser("show", help="every field of one dead letter")
    dshow.add_argument("id", type=handle_arg, help="dead-letter id (from dlq list)")
    dre = dsub.add_parser(
        "redrive", help="re-send dead letters to the stream they came from (source_stream)"
    )
    dre.add_argument("--limit", type=_positive_int, help="at most this many (default: all)")
    dre.add_argument("--rate", type=float, help="at most this many per second")
    dre.add_argument("--id", dest="entry_id", type=handle_arg, help="only this dead letter")
    dpurge = dsub.add_parser("purge", help="delete dead letters (all with --yes, or --id)")
    dpurge.add_argument("--id", dest="entry_id", type=handle_arg, help="only this dead letter")
    dpurge.add_argument("--session", help="only the dead letters of this session")
    dpurge.add_argument(
        "--older-than", type=duration_arg, help="only those older than this (90s, 15m, 2h, 7d)"
    )
    dpurge.add_argument("--yes", action="store_true", help="confirm deleting every dead letter")

    reshard = sub.add_parser(
        "reshard", help="offline: move a drained deployment from DIALOG_SHARDS to --to N shards"
    )
    reshard.add_argument(
        "--to", type=_positive_int, required=True, dest="to_shards", help="new shard count"
    )
    reshard.add_argument("--dry-run", action="store_true", help="report, change nothing")
    reshard.add_argument(
        "--yes", action="store_true", help="move the keys (without it: report what would move)"
    )
    reshard.add_argument(
        "--force",
        action="store_true",
        help="skip the check that no consumer of the group was active recently",
    )

    serve = sub.add_parser(
        "serve",
        help="the HTTP gateway: send messages and stream their answers to browsers (needs "
        "dialog-worker[http])",
    )
    serve.add_argument("--host", help="address to listen on (default DIALOG_HTTP_HOST, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default DIALOG_HTTP_PORT, 8080)")
    serve.add_argument(
        "--no-auth",
        action="store_true",
        help="accept requests without DIALOG_HTTP_TOKEN (only on a loopback address)",
    )

    verify = sub.add_parser("verify", help="concurrency verification against running workers")
    verify.add_argument("--sessions", type=_positive_int, default=50, help="sessions (default 50)")
    verify.add_argument(
        "--burst", type=_positive_int, default=10, help="messages per session (default 10)"
    )
    verify.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for replies (default 120)"
    )
    limits = sub.add_parser(
        "limits",
        help="model-provider limit keys: one JSON line per key (limits), change a key's limits "
        "for every worker (limits set), close it for a while (limits pause) or reopen it now "
        "(limits resume); each audited",
    )
    lsub = limits.add_subparsers(dest="limits_command", metavar="ACTION")
    lset = lsub.add_parser(
        "set", help="set some of a key's limits for every worker (0: no limit; wins over settings)"
    )
    lset.add_argument("key", help="the limit key, e.g. openai:gpt-4.1")
    lset.add_argument("--rpm", type=_limit_value, help="requests per minute (0: none)")
    lset.add_argument("--tpm", type=_limit_value, help="tokens per minute (0: none)")
    lset.add_argument(
        "--max-in-flight", type=_limit_value, help="calls at once on the key (0: none)"
    )
    lset.add_argument("--reason", default="", help="recorded in the audit stream")
    lpause = lsub.add_parser(
        "pause",
        help="close a key for every worker for a while (as after a provider's 429); waiting "
        "messages resume in order when it opens; a longer pause in force is kept",
    )
    lpause.add_argument("key", help="the limit key")
    lpause.add_argument(
        "--for", dest="for_s", type=_seconds, required=True, metavar="SECONDS", help="how long"
    )
    lpause.add_argument("--reason", required=True, help="why (recorded in the audit stream)")
    lresume = lsub.add_parser(
        "resume",
        help="reopen a paused key now, for every worker (a provider's pause or an operator's): "
        "waiting messages go from now, in the order they were refused",
    )
    lresume.add_argument("key", help="the limit key")
    lresume.add_argument("--reason", required=True, help="why (recorded in the audit stream)")

    tenants_cmd = sub.add_parser(
        "tenants",
        help="tenants with settings or usage today, one JSON line each (tenants); change one "
        "tenant's settings (tenants set TENANT ...), audited",
    )
    tsub = tenants_cmd.add_subparsers(dest="tenants_command", metavar="ACTION")
    tset = tsub.add_parser("set", help="change some of a tenant's settings (the others are kept)")
    tset.add_argument("tenant", help="the tenant's name")
    tset.add_argument("--weight", type=_weight, help="its share of the slots (default 1)")
    tset.add_argument("--min", type=_tenant_count, help="slots it is always given (default 0)")
    tset.add_argument("--max", type=_tenant_count, help="most slots it may hold (0: no cap)")
    tset.add_argument(
        "--daily-tokens",
        type=_tenant_count,
        help="tokens a UTC day (0: no budget; unset: DIALOG_TENANT_DAILY_TOKENS)",
    )
    tset.add_argument("--reason", default="", help="recorded in the audit stream")

    console = sub.add_parser(
        "console", help="web console for operators (needs the http extra; docs/console.md)"
    )
    console.add_argument("--host", help="address to listen on (DIALOG_CONSOLE_HOST)")
    console.add_argument(
        "--port", type=int, help="port to listen on (DIALOG_CONSOLE_PORT, default 8090)"
    )
    bench.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides: dict[str, Any] = {}
    if args.command == "console":
        overrides = {"console_host": args.host, "console_port": args.port}
    if args.command == "run":
        overrides = {"concurrency": args.concurrency, "consumer": args.consumer}
        # A stop asked for while the worker is still starting (nothing taken yet) is a clean
        # exit 0, not a death by signal; the worker installs its graceful handlers once running.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _stop_while_starting)
    settings: Settings | None = None
    try:
        settings = load_settings(overrides)
        if args.command == "run":
            return _run(settings, args.processes, overrides)
        traced = args.command in TRACED_COMMANDS and tracing.setup(TRACED_COMMANDS[args.command])
        try:
            return int(anyio.run(_COMMANDS[args.command], settings, args))
        finally:
            if traced:
                tracing.shutdown()  # export the spans of this command before exit
    except KeyboardInterrupt:
        print("dialog-worker: interrupted", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:
        return _report(exc, settings)


def _stop_while_starting(signum: int, frame: object) -> None:
    raise SystemExit(EXIT_OK)


def _report(exc: BaseException, settings: Settings | None) -> int:
    """Every error as one line on stderr; the exit code says whose problem it is."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]  # raised inside a task group
    code = EXIT_FAILURE
    if isinstance(exc, ConfigError):
        line, code = f"invalid setting {exc}", EXIT_USAGE
    elif isinstance(exc, ValidationError):
        line, code = str(exc), EXIT_USAGE
    elif isinstance(exc, redis.exceptions.RedisError | redis.exceptions.RedisClusterException):
        where = settings.redacted_url() if settings else "Redis"
        line = f"redis error at {where}: {type(exc).__name__}: {exc}"
        if isinstance(exc, redis.exceptions.ConnectionError) and settings is not None:
            if settings.redis_url == embedded_redis_url():
                line += " (REDIS_URL=embedded: the server runs while `dialog-worker run` does)"
    elif isinstance(exc, OSError | RuntimeError | EngineHookError):  # their text says enough
        line = str(exc)
    else:
        line = f"{type(exc).__name__}: {exc}"
        if settings is not None and settings.log_level == "debug":
            traceback.print_exception(exc, file=sys.stderr)
    line = " ".join(redact_url(w) if "://" in w else w for w in line.split())
    print(f"dialog-worker: {line}", file=sys.stderr)
    return code


def _run(settings: Settings, processes: int, flags: dict[str, Any]) -> int:
    from dialog_worker.config import DEFAULT_BUDGET_REPLY, DEFAULT_FALLBACK_REPLY
    from dialog_worker.daemon.supervisor import SUPERVISOR_PID_ENV
    from dialog_worker.engine.loading import load_engine
    from dialog_worker.engine.protocol import budget_reply, fallback_reply
    from dialog_worker.log import configure
    from dialog_worker.store import embedded_redis as local

    configure(settings.log_level, settings.log_format, settings.consumer)
    engine = load_engine(settings.engine or None, settings.rules_file or None)
    # What dead-lettered messages and messages over a budget are answered, in the bot's own
    # language when the engine says (unless the settings do).
    settings = settings.replace(
        fallback_reply=fallback_reply(engine, settings.fallback_reply, DEFAULT_FALLBACK_REPLY),
        budget_reply=budget_reply(engine, settings.budget_reply, DEFAULT_BUDGET_REPLY),
    )
    embedded = None
    if local.wanted(settings.redis_url):
        embedded = local.ensure_local_redis()
        settings = settings.replace(redis_url=local.url())
        flags = {**flags, "redis_url": settings.redis_url}  # children use ours, start none
    elif settings.redis_url == embedded_redis_url() and SUPERVISOR_PID_ENV not in os.environ:
        embedded = local.ensure_own_redis()  # REDIS_URL=embedded (a supervisor's child: started)
    try:
        if processes > 1:
            return _supervise(settings, processes, flags)
        from dialog_worker.daemon.supervisor import watch_supervisor
        from dialog_worker.daemon.worker import run_worker

        watch_supervisor()
        run_worker(settings, engine)
    except ConfigError:
        raise
    except Exception as exc:
        # A daemon that dies logs why, traceback included, as one JSON line like the others,
        # and says it in one line on stderr (an engine whose startup() raised, for one).
        structlog.get_logger("dialog_worker").exception("worker_crashed")
        return _report(exc, settings)
    finally:
        if embedded is not None:  # only now: the worker has finished its graceful shutdown
            local.stop(embedded)
    return EXIT_OK


def _supervise(settings: Settings, processes: int, flags: dict[str, Any]) -> int:
    from dialog_worker.config import default_consumer, env_name
    from dialog_worker.daemon.supervisor import GaveUp, Supervisor, run_supervisor

    # Children read the same environment and config file; what only we know goes into theirs.
    env = dict(os.environ)
    env.update({env_name(k): str(v) for k, v in flags.items() if v is not None})
    explicit = settings.consumer != default_consumer()
    supervisor = Supervisor(
        processes,
        child_env=env,
        metrics_host=settings.metrics_host,
        metrics_port=settings.metrics_port,
        shutdown_grace_s=settings.shutdown_grace_s,
        consumer=settings.consumer if explicit else None,
    )
    try:
        return run_supervisor(supervisor)
    except GaveUp as exc:  # each death was logged, and its stderr passed on, as it happened
        print(f"dialog-worker: {exc}", file=sys.stderr)
        return EXIT_FAILURE


async def _send(settings: Settings, args: argparse.Namespace) -> int:
    async with DialogClient(settings=settings) as c:
        r = await c.send(
            args.session,
            args.text,
            msg_id=args.msg_id,
            expires_at=args.expires_at,
            deliver_at=args.deliver_at,
            tenant=args.tenant,
            priority=args.priority,
        )
    _emit(r.as_dict())
    return EXIT_OK


async def _ask(settings: Settings, args: argparse.Namespace) -> int:
    if args.stream:
        return await _ask_stream(settings, args)
    async with DialogClient(settings=settings) as c:
        try:
            reply = await c.ask(
                args.session,
                args.text,
                msg_id=args.msg_id,
                timeout=args.timeout,
                expires_at=args.expires_at,
                tenant=args.tenant,
                priority=args.priority,
            )
        except (ReplyTimeout, ReplyStreamError) as exc:
            print(f"dialog-worker: {exc}", file=sys.stderr)
            return EXIT_FAILURE
    _emit(reply.as_dict())
    return EXIT_FAILURE if reply.outcome == "dead_lettered" else EXIT_OK


async def _ask_stream(settings: Settings, args: argparse.Namespace) -> int:
    outcome = ""
    async with DialogClient(settings=settings) as c:
        try:
            async for event in c.ask_stream(
                args.session,
                args.text,
                msg_id=args.msg_id,
                timeout=args.timeout,
                expires_at=args.expires_at,
                tenant=args.tenant,
                priority=args.priority,
            ):
                _emit({"session_id": args.session, **event.as_dict()})
                outcome = event.outcome or ""
                if event.kind == "event" and event.event_kind == "awaiting":
                    break  # it waits for a person: `dialog-worker resume` answers
        except (ReplyTimeout, ReplyStreamError) as exc:
            print(f"dialog-worker: {exc}", file=sys.stderr)
            return EXIT_FAILURE
    return EXIT_FAILURE if outcome in ("dead_lettered", "expired") else EXIT_OK


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


async def _cancel(settings: Settings, args: argparse.Namespace) -> int:
    async with DialogClient(settings=settings) as c:
        _emit((await c.cancel(args.session, args.msg_id)).as_dict())
    return EXIT_OK


async def _pending(settings: Settings, args: argparse.Namespace) -> int:
    async with DialogClient(settings=settings) as c:
        for found in await c.pending(args.session):
            _emit(found.as_dict())
    return EXIT_OK


async def _resume(settings: Settings, args: argparse.Namespace) -> int:
    async with DialogClient(settings=settings) as c:
        result = await c.resume(args.session, args.interrupt_id, args.value)
    _emit(result.as_dict())
    return EXIT_OK if result.status in ("resumed", "already_resumed") else EXIT_FAILURE


async def _token(settings: Settings, args: argparse.Namespace) -> int:
    from dialog_worker.client import session_tokens

    actions = args.actions.split(",") if args.actions else None
    if not settings.http_signing_key:
        raise ConfigError("DIALOG_HTTP_SIGNING_KEY", "not set: it signs the session tokens")
    token = session_tokens.mint(settings.http_signing_key, args.session, args.ttl, actions)
    grant = session_tokens.verify(settings.http_signing_key, token)
    _emit(
        {
            "token": token,
            "session_id": grant.session_id,
            "actions": list(grant.actions),
            "expires_at": grant.expires_at,
        }
    )
    return EXIT_OK


async def _state(settings: Settings, args: argparse.Namespace) -> int:
    async with DialogClient(settings=settings) as c:
        _emit(await c.state(args.session))
    return EXIT_OK


async def _session(settings: Settings, args: argparse.Namespace) -> int:
    from dialog_worker.store.codec import check_id
    from dialog_worker.store.queue_view import session_view

    check_id("session_id", args.session)
    if args.target is not None:
        return await _erase_session(settings, args)
    if args.release_lock and not args.yes:
        raise ValidationError("--release-lock deletes another worker's lock: add --yes")
    async with DialogClient(settings=settings) as c:
        keys = c.keys_for(args.session)
        view = await session_view(c.redis, keys, args.session, c.entries)
        if args.release_lock:
            released = await c.redis.delete(keys.session(args.session).lock)
            view["lock_released"] = bool(released)
            if released:
                # Due now: a session held under a worker lease sits out of the resumers'
                # sight until its holder's lease lapses (docs/architecture.md).
                sec, usec = await c.redis.time()
                await c.redis.zadd(keys.ready, {args.session: sec * 1000 + usec // 1000}, xx=True)
        _emit(view)
    return EXIT_OK


async def _erase_session(settings: Settings, args: argparse.Namespace) -> int:
    action = args.session
    if action not in ("reset", "delete"):
        raise ValidationError(
            f"session takes one session id, or reset|delete and one: got {action!r} and "
            f"{args.target!r}"
        )
    if not args.yes:
        raise ValidationError(f"session {action} cannot be undone: add --yes")
    if args.release_lock or (args.purge_replies and action == "reset"):
        raise ValidationError("--release-lock and --purge-replies do not go with reset")
    who = "cli:" + (os.environ.get("USER") or os.environ.get("LOGNAME") or "unknown")
    async with DialogClient(settings=settings) as c:
        if action == "reset":
            result = await c.reset(args.target, who=who, reason=args.reason)
        else:
            result = await c.delete(
                args.target, who=who, reason=args.reason, replies=args.purge_replies
            )
    _emit(result.as_dict())
    return EXIT_OK


def _who() -> str:
    return "cli:" + (os.environ.get("USER") or os.environ.get("LOGNAME") or "unknown")


async def _limits(settings: Settings, args: argparse.Namespace) -> int:
    from dialog_worker.ops import model_limits

    async with DialogClient(settings=settings) as c:
        if args.limits_command == "set":
            _emit(
                await model_limits.set_limits(
                    c.redis,
                    settings,
                    args.key,
                    _who(),
                    rpm=args.rpm,
                    tpm=args.tpm,
                    max_in_flight=args.max_in_flight,
                    reason=args.reason,
                )
            )
        elif args.limits_command == "pause":
            _emit(
                await model_limits.pause_key(
                    c.redis, settings, args.key, args.for_s, args.reason, _who(), "cli"
                )
            )
        elif args.limits_command == "resume":
            _emit(
                await model_limits.resume_key(
                    c.redis, settings, args.key, args.reason, _who(), "cli"
                )
            )
        else:
            for row in await model_limits.list_limits(c.redis, settings):
                _emit(row)
    return EXIT_OK


async def _tenants(settings: Settings, args: argparse.Namespace) -> int:
    from dialog_worker.ops import model_limits

    async with DialogClient(settings=settings) as c:
        if args.tenants_command == "set":
            _emit(
                await model_limits.set_tenant(
                    c.redis,
                    settings,
                    args.tenant,
                    _who(),
                    args.reason,
                    weight=args.weight,
                    min=args.min,
                    max=args.max,
                    daily_tokens=args.daily_tokens,
                )
            )
        else:
            for row in await model_limits.list_tenants(c.redis, settings):
                _emit(row)
    return EXIT_OK


async def _stats(settings: Settings, args: argparse.Namespace) -> int:
    from dialog_worker.store.queue_view import aggregate_stats

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
    from dialog_worker.ops.verify import verify

    async with DialogClient(settings=settings, max_connections=200) as c:
        # The built-in rules' conversation only where the workers run them (the same settings:
        # DIALOG_ENGINE unset); the exactly-once, in-order checks hold for every engine.
        rules = not settings.engine
        report = await verify(c, args.sessions, args.burst, args.timeout, rules=rules)
    _emit(report.as_dict())
    return EXIT_OK if report.ok else EXIT_FAILURE


async def _dlq(settings: Settings, args: argparse.Namespace) -> int:
    from dialog_worker.ops import dead_letters as dlq

    async with DialogClient(settings=settings) as c:
        if args.dlq_command == "list":
            for row in await dlq.list_entries(_shards(c, args), c, args.limit):
                _emit(row)
        elif args.dlq_command == "show":
            _emit(await dlq.show(_shards(c, args), c, args.id))  # none: NoSuchLetter, exit 1
        elif args.dlq_command == "redrive":
            if args.rate is not None and args.rate <= 0:
                raise ValidationError("--rate must be positive")
            _emit(await dlq.redrive(_shards(c, args), c, args.limit, args.rate, args.entry_id))
        else:
            narrowed = (args.entry_id, args.session, args.older_than) != (None, None, None)
            if not narrowed and not args.yes:
                raise ValidationError("dlq purge deletes every dead letter: add --yes (or --id ID)")
            purged = await dlq.purge(
                _shards(c, args),
                c,
                args.entry_id,
                session_id=args.session,
                older_than_s=args.older_than,
            )
            _emit({"purged": purged})
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
    from dialog_worker.ops.reshard import Interrupted, Refused, reshard, stop_after
    from dialog_worker.store.connection import connect, prepare

    try:
        target = settings.replace(shards=args.to_shards)
    except ConfigError as exc:
        raise ValidationError(f"--to: {exc.problem}") from None
    dry_run = args.dry_run or not args.yes
    # Fault injection for the tests: stop the run after this many writes (as a kill would).
    stop = os.environ.get("DIALOG_RESHARD_STOP_AFTER")
    # Bytes in and out: dead letters are copied byte for byte. Not a DialogClient: its shard
    # count check refuses while a reshard is in progress, and this run may be its resumption.
    redis = connect(settings, max_connections=4, decode_responses=False)
    try:
        await prepare(redis)
        report = await reshard(
            redis,
            settings,
            target,
            dry_run=dry_run,
            force=args.force,
            checkpoint=stop_after(int(stop)) if stop else None,
        )
    except Refused as exc:
        print(f"dialog-worker: reshard refused: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except Interrupted as exc:
        print(f"dialog-worker: reshard interrupted: {exc}", file=sys.stderr)
        _emit({"from_shards": settings.shards, "to_shards": target.shards, **exc.report.as_dict()})
        return EXIT_FAILURE
    finally:
        await redis.aclose()
    if dry_run:
        print("dialog-worker: nothing changed (dry run); add --yes to move", file=sys.stderr)
    _emit({"from_shards": settings.shards, "to_shards": target.shards, **report.as_dict()})
    return EXIT_OK


async def _console(settings: Settings, args: argparse.Namespace) -> int:
    from dialog_worker.console import MISSING_EXTRA, serve
    from dialog_worker.console.auth import NoUsers

    try:
        await serve(settings)
    except NoUsers as exc:
        raise ValidationError(str(exc)) from None
    except ModuleNotFoundError as exc:
        if exc.name not in ("starlette", "uvicorn", "jinja2"):
            raise
        raise ValidationError(MISSING_EXTRA) from None
    return EXIT_OK


async def _serve(settings: Settings, args: argparse.Namespace) -> int:
    try:
        from dialog_worker.gateway.serve import serve
    except ModuleNotFoundError as exc:
        raise ConfigError("serve", f"needs {exc.name}: pip install 'dialog-worker[http]'") from None
    host = args.host or settings.http_host
    port = args.port if args.port is not None else settings.http_port
    return await serve(settings, host, port, args.no_auth)


# Commands that trace what they do when the OTEL_* variables ask for it (service names).
TRACED_COMMANDS = {
    "send": "dialog-worker-cli",
    "ask": "dialog-worker-cli",
    "serve": "dialog-worker-gateway",
}

_COMMANDS: dict[str, Callable[[Settings, argparse.Namespace], Awaitable[int]]] = {
    "send": _send,
    "ask": _ask,
    "serve": _serve,
    "replies": _replies,
    "cancel": _cancel,
    "pending": _pending,
    "resume": _resume,
    "state": _state,
    "token": _token,
    "session": _session,
    "stats": _stats,
    "verify": _verify,
    "dlq": _dlq,
    "reshard": _reshard,
    "limits": _limits,
    "tenants": _tenants,
    "bench": bench.bench_command,
    "console": _console,
}
