"""The console's ASGI app: server-rendered pages (Jinja2, autoescaped), a JSON endpoint the
overview polls for live numbers, and POST actions.

Every request is authenticated (auth.py); a POST is refused with 403 unless the user is an
operator *and* the form carries a valid form token (CSRF) *and* any Origin header names this
console. Responses forbid framing and inline scripts (Content-Security-Policy), so text read
from Redis (session ids, messages, errors), which is always escaped, could not run even if a
template forgot to.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import jinja2
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings
from dialog_worker.console import actions, reads
from dialog_worker.console.audit import AuditLog
from dialog_worker.console.auth import Authenticator, User
from dialog_worker.errors import ValidationError
from dialog_worker.ops import model_limits
from dialog_worker.store.codec import check_id
from dialog_worker.store.keys import audit_key
from dialog_worker.version import __version__

log = structlog.get_logger("dialog_worker.console.app")

HERE = Path(__file__).resolve().parent
MAX_FORM_BYTES = 64 * 1024
MAX_REASON_CHARS = 500
AUDIT_PAGE = 50
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d)?")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    # Not no-referrer: with it, browsers send "Origin: null" on our own form posts.
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


class Console:
    """The state one app holds: settings, a client, who may sign in, the audit log."""

    def __init__(self, settings: Settings, client: DialogClient | None = None) -> None:
        self.settings = settings
        self.auth = Authenticator(settings)  # raises NoUsers first: no users, no console
        self._own_client = client is None
        self.client = client or DialogClient(settings=settings, max_connections=32)
        self.audit = AuditLog(
            self.client.redis, self.client.raw, audit_key(settings), settings.console_audit_maxlen
        )
        self.redact = reads.Redactor.from_setting(settings.console_redact_fields)
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            # Lenient: the session view grows fields over time; a missing one shows as empty.
            undefined=jinja2.ChainableUndefined,
        )
        self.templates.filters["q"] = lambda v: urllib.parse.quote(str(v), safe="")
        self.templates.filters["utc"] = _utc
        self.templates.filters["show"] = lambda v: "—" if v is None or v == "" else v
        self.templates.filters["plural"] = lambda n, word: f"{n} {word}{'' if n == 1 else 's'}"

    async def aclose(self) -> None:
        if self._own_client:
            await self.client.aclose()

    # -- helpers -----------------------------------------------------------------------------

    def user(self, request: Request) -> User:
        user = self.auth.authenticate(request.headers.get("authorization"))
        if user is None:
            raise HTTPException(
                401,
                "sign in with your console name and token",
                headers={
                    "www-authenticate": 'Basic realm="dialog-worker console", charset="UTF-8"'
                },
            )
        return user

    def page(
        self, request: Request, user: User, name: str, status: int = 200, **ctx: Any
    ) -> Response:
        html = self.templates.get_template(name).render(
            user=user,
            form_token=self.auth.form_token(user) if user.can_act else "",
            version=__version__,
            stream=self.settings.stream,
            **ctx,
        )
        return HTMLResponse(html, status_code=status)

    async def form(self, request: Request, user: User) -> dict[str, list[str]]:
        """The body of an action: refused (403) for a viewer before it is read, then unless
        its form token and Origin are right."""
        if not user.can_act:
            raise HTTPException(403, f"{user.name} is a viewer: viewers cannot act")
        origin = request.headers.get("origin")
        if origin is not None and origin != _own_origin(request):
            raise HTTPException(403, "the request came from another site")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                raise HTTPException(413, "the form is too large")
        try:
            fields = urllib.parse.parse_qs(
                body.decode("utf-8"), keep_blank_values=True, strict_parsing=False
            )
        except UnicodeDecodeError:
            raise HTTPException(400, "the form is not UTF-8") from None
        token = (fields.get("form_token") or [""])[0]
        if not self.auth.check_form_token(user, token):
            raise HTTPException(403, "the form token is missing or expired: reload the page")
        return fields


def _utc(ms: object) -> str:
    try:
        when = datetime.datetime.fromtimestamp(int(str(ms)) / 1000, datetime.UTC)
    except (ValueError, OverflowError, OSError):
        return str(ms)
    return when.strftime("%Y-%m-%d %H:%M:%S")


def _own_origin(request: Request) -> str:
    return f"{request.url.scheme}://{request.headers.get('host', '')}"


def _one(fields: dict[str, list[str]], name: str) -> str:
    return (fields.get(name) or [""])[0]


def _reason(fields: dict[str, list[str]]) -> str:
    reason = " ".join(_one(fields, "reason").split())
    if not reason:
        raise HTTPException(400, "a reason is required")
    if len(reason) > MAX_REASON_CHARS:
        raise HTTPException(400, f"the reason is longer than {MAX_REASON_CHARS} characters")
    return reason


def _listed(fields: dict[str, list[str]]) -> list[str]:
    """The handles the page listed and the operator kept ticked, with the count the page
    showed on its button: a form whose count differs acted on letters nobody saw."""
    handles = [h for h in fields.get("handle", []) if h]
    if not handles:
        raise HTTPException(400, "no dead letters were listed")
    if len(handles) > reads.PAGE_MAX:
        raise HTTPException(400, f"at most {reads.PAGE_MAX} letters per action")
    if _one(fields, "count") != str(len(handles)):
        raise HTTPException(
            400,
            f"the page said {_one(fields, 'count') or 'no'} letters but {len(handles)} were "
            "sent: reload the page",
        )
    return handles


def _limit(raw: str | None) -> int:
    if raw is None or raw == "":
        return reads.PAGE_DEFAULT
    if not raw.isascii() or not raw.isdigit() or int(raw) < 1:
        raise HTTPException(400, f"limit must be a whole number from 1 to {reads.PAGE_MAX}")
    return min(int(raw), reads.PAGE_MAX)


def _duration(raw: str | None) -> float | None:
    if not raw:
        return None
    match = _DURATION.fullmatch(raw.strip())
    if match is None:
        raise HTTPException(400, "older than: a duration like 90s, 15m, 2h or 7d")
    return float(match.group(1)) * _UNIT_S[match.group(2) or "s"]


def _session_id(raw: str | None) -> str:
    try:
        return reads.session_id_arg(raw)
    except ValidationError as exc:
        raise HTTPException(400, str(exc)) from None


# -- pages ------------------------------------------------------------------------------------

Handler = Callable[[Console, Request], Awaitable[Response]]


async def overview_page(c: Console, request: Request) -> Response:
    user = c.user(request)
    paused = await model_limits.paused_keys(c.client.redis, c.settings)
    return c.page(
        request, user, "overview.html", data=await reads.overview(c.client), paused_keys=paused
    )


async def overview_json(c: Console, request: Request) -> Response:
    c.user(request)
    return JSONResponse(await reads.overview(c.client))


async def session_json(c: Console, request: Request) -> Response:
    c.user(request)
    session_id = _session_id(request.query_params.get("id"))
    data = await reads.timeline(c.client, session_id, c.redact)
    return JSONResponse(data, status_code=200 if data["found"] else 404)


async def letters_json(c: Console, request: Request) -> Response:
    c.user(request)
    flt, limit, cursor = _letter_query(request)
    page = await _letters(c, flt, cursor, limit)
    return JSONResponse(
        {"letters": page.rows, "next_after": page.next_cursor, "scanned": page.scanned}
    )


async def session_page(c: Console, request: Request) -> Response:
    user = c.user(request)
    raw = request.query_params.get("id")
    if raw is None or raw == "":
        return c.page(request, user, "find.html", dedupe_ttl_s=c.settings.dedupe_ttl_s)
    session_id = _session_id(raw)
    data = await reads.timeline(c.client, session_id, c.redact)
    return c.page(request, user, "session.html", t=data, status=200 if data["found"] else 404)


async def session_redrive(c: Console, request: Request) -> Response:
    user = c.user(request)
    fields = await c.form(request, user)
    session_id = _session_id(_one(fields, "session_id"))
    reason = _reason(fields)
    handles = _listed(fields)
    return await _act(
        c,
        request,
        user,
        "redrive_session",
        f"session {session_id}",
        reason,
        handles,
        lambda: actions.redrive(c.client, handles, session_id=session_id),
        back=f"/session?id={urllib.parse.quote(session_id, safe='')}",
    )


async def session_hold(c: Console, request: Request) -> Response:
    """Hold or release a session (the form's `action`)."""
    user = c.user(request)
    fields = await c.form(request, user)
    session_id = _session_id(_one(fields, "session_id"))
    action = _one(fields, "action")
    if action not in ("hold", "release"):
        raise HTTPException(400, "action must be hold or release")
    reason = _reason(fields)
    run = (
        (lambda: actions.hold(c.client, session_id, user.name))
        if action == "hold"
        else (lambda: actions.release(c.client, session_id))
    )
    return await _act(
        c,
        request,
        user,
        f"{action}_session",
        f"session {session_id}",
        reason,
        [],
        run,
        back=f"/session?id={urllib.parse.quote(session_id, safe='')}",
    )


async def session_cancel(c: Console, request: Request) -> Response:
    """Cancel one waiting message of a session, by its msg_id (the client's cancel)."""
    user = c.user(request)
    fields = await c.form(request, user)
    session_id = _session_id(_one(fields, "session_id"))
    try:
        msg_id = check_id("msg_id", _one(fields, "msg_id"))
    except ValidationError as exc:
        raise HTTPException(400, str(exc)) from None
    reason = _reason(fields)
    return await _act(
        c,
        request,
        user,
        "cancel_message",
        f"session {session_id} message {msg_id}",
        reason,
        [],
        lambda: actions.cancel(c.client, session_id, msg_id),
        back=f"/session?id={urllib.parse.quote(session_id, safe='')}",
    )


def _msg_id(raw: str | None) -> str:
    try:
        return check_id("msg_id", raw if raw is not None else "")
    except ValidationError as exc:
        raise HTTPException(400, str(exc)) from None


async def message_find(c: Console, request: Request) -> Response:
    """Find a message by its exact msg_id: straight to its session's page when one session
    has it, a list when several shards do, 404 when none does."""
    user = c.user(request)
    msg_id = _msg_id(request.query_params.get("msg_id"))
    found = await reads.find_message(c.client, msg_id)
    if len(found) == 1:
        sid = urllib.parse.quote(found[0]["session_id"], safe="")
        return RedirectResponse(f"/session?id={sid}", status_code=303)
    return c.page(
        request,
        user,
        "find.html",
        msg_id=msg_id,
        found=found,
        dedupe_ttl_s=c.settings.dedupe_ttl_s,
        status=200 if found else 404,
    )


async def sessions_prefix(c: Console, request: Request) -> Response:
    """Sessions whose id starts with `prefix` (those that received a message lately)."""
    user = c.user(request)
    prefix = request.query_params.get("prefix") or ""
    if not prefix.strip() or len(prefix.encode("utf-8")) > 256:
        raise HTTPException(400, "prefix: 1 to 256 bytes")
    ids, more = await reads.sessions_by_prefix(c.client, prefix)
    if request.url.path.startswith("/api/"):
        return JSONResponse({"prefix": prefix, "sessions": ids, "more": more})
    return c.page(
        request,
        user,
        "find.html",
        prefix=prefix,
        prefix_found=ids,
        prefix_more=more,
        dedupe_ttl_s=c.settings.dedupe_ttl_s,
    )


async def message_json(c: Console, request: Request) -> Response:
    c.user(request)
    msg_id = _msg_id(request.query_params.get("msg_id"))
    found = await reads.find_message(c.client, msg_id)
    return JSONResponse({"msg_id": msg_id, "sessions": found}, status_code=200 if found else 404)


async def message_life_page(c: Console, request: Request) -> Response:
    """One message's life: its attempts, waits, model calls and journaled calls
    (``?session=<id>&msg_id=<id>``; JSON under /api/)."""
    user = c.user(request)
    session_id = _session_id(request.query_params.get("session"))
    msg_id = _msg_id(request.query_params.get("msg_id"))
    data = await reads.message_life(c.client, session_id, msg_id, c.redact)
    status = 200 if data["found"] else 404
    if request.url.path.startswith("/api/"):
        return JSONResponse(data, status_code=status)
    return c.page(request, user, "message.html", m=data, status=status)


async def letters_list(c: Console, request: Request) -> Response:
    user = c.user(request)
    q = request.query_params
    session_raw = q.get("session") or None
    flt, limit, cursor = _letter_query(request)
    page = await _letters(c, flt, cursor, limit)
    keep = {
        k: v
        for k, v in (
            ("kind", q.get("kind")),
            ("session", session_raw),
            ("older_than", q.get("older_than")),
            ("limit", q.get("limit")),
        )
        if v
    }
    next_url = (
        "/letters?" + urllib.parse.urlencode({**keep, "after": page.next_cursor})
        if page.next_cursor
        else None
    )
    return c.page(
        request,
        user,
        "letters.html",
        page=page,
        flt=flt,
        filters=keep,
        limit=limit,
        next_url=next_url,
        first_url="/letters?" + urllib.parse.urlencode(keep),
        cursor=cursor,
    )


def _letter_query(request: Request) -> tuple[reads.LetterFilter, int, str | None]:
    q = request.query_params
    session_raw = q.get("session") or None
    flt = reads.LetterFilter(
        kind=q.get("kind") or None,
        session_id=_session_id(session_raw) if session_raw else None,
        older_than_s=_duration(q.get("older_than")),
    )
    return flt, _limit(q.get("limit")), q.get("after") or None


async def _letters(
    c: Console, flt: reads.LetterFilter, cursor: str | None, limit: int
) -> reads.LetterPage:
    try:
        return await reads.letters_page(c.client, flt, cursor, limit, c.redact)
    except ValidationError as exc:
        raise HTTPException(400, str(exc)) from None


async def letters_action(c: Console, request: Request) -> Response:
    user = c.user(request)
    fields = await c.form(request, user)
    action = _one(fields, "action")
    if action not in ("redrive", "purge"):
        raise HTTPException(400, "action must be redrive or purge")
    reason = _reason(fields)
    handles = _listed(fields)
    run = actions.redrive if action == "redrive" else actions.purge
    return await _act(
        c,
        request,
        user,
        f"{action}_letters",
        f"{len(handles)} listed letters",
        reason,
        handles,
        lambda: run(c.client, handles),
        back=_one(fields, "back") or "/letters",
    )


async def _act(
    c: Console,
    request: Request,
    user: User,
    action: str,
    target: str,
    reason: str,
    handles: list[str],
    run: Callable[[], Awaitable[actions.Outcome]],
    back: str,
) -> Response:
    asked: dict[str, Any] = {"handles": handles, "count": len(handles)} if handles else {}
    ref = await c.audit.append(user, action, target, reason, "requested", asked)
    try:
        outcome = await run()
    except ValidationError as exc:
        await c.audit.append(user, action, target, reason, "refused", {"error": str(exc)}, ref)
        raise HTTPException(400, str(exc)) from None
    except Exception as exc:
        # Stopped part way: what was done is done, and the audit says so, not only "requested".
        done = exc.outcome if isinstance(exc, actions.ActionFailed) else None
        detail = {**(done.as_dict() if done else {}), "error": str(exc) or type(exc).__name__}
        try:
            await c.audit.append(user, action, target, reason, "failed", detail, ref)
        except Exception as audit_exc:  # Redis is away: the log is all that is left
            log.error("audit_outcome_lost", action=action, ref=ref, error=str(audit_exc))
        so_far = f"{done.done} of {len(handles)} listed done before it; " if done else ""
        raise HTTPException(
            503, f"{action} failed part way: {so_far}see the audit log ({exc})"
        ) from None
    await c.audit.append(user, action, target, reason, "done", outcome.as_dict(), ref)
    if not back.startswith(("/letters", "/session?", "/limits")):  # never another site
        back = "/"
    return c.page(
        request,
        user,
        "done.html",
        action=action,
        target=target,
        reason=reason,
        listed=len(handles),
        outcome=outcome,
        back=back,
        ref=ref,
    )


async def limits_page(c: Console, request: Request) -> Response:
    """The model-provider limit keys (limits, calls holding a slot, pause, last minute's
    rate) and the tenants' settings and usage of the day; operators may pause a key, and
    resume a paused one."""
    user = c.user(request)
    keys = await model_limits.list_limits(c.client.redis, c.settings)
    tenants = await model_limits.list_tenants(c.client.redis, c.settings)
    return c.page(request, user, "limits.html", keys=keys, tenants=tenants)


async def limits_pause(c: Console, request: Request) -> Response:
    """Pause a limit key for every worker (an operator's action, audited)."""
    user = c.user(request)
    fields = await c.form(request, user)
    key = _one(fields, "key")
    reason = _reason(fields)
    for_s = _duration(_one(fields, "for"))
    if for_s is None or not 0 < for_s <= 7 * 86400:
        raise HTTPException(400, "for: a duration above 0 and at most 7 days (90s, 15m, 2h)")

    async def run() -> actions.Outcome:
        await model_limits.pause_key(
            c.client.redis, c.settings, key, for_s, reason, user.name, str(user.role), record=False
        )
        return actions.Outcome(done=1)

    return await _act(
        c, request, user, "pause_limit_key", f"limit key {key}", reason, [], run, back="/limits"
    )


async def limits_resume(c: Console, request: Request) -> Response:
    """Reopen a paused limit key now, for every worker (an operator's action, audited)."""
    user = c.user(request)
    fields = await c.form(request, user)
    key = _one(fields, "key")
    reason = _reason(fields)

    async def run() -> actions.Outcome:
        await model_limits.resume_key(
            c.client.redis, c.settings, key, reason, user.name, str(user.role), record=False
        )
        return actions.Outcome(done=1)

    return await _act(
        c, request, user, "resume_limit_key", f"limit key {key}", reason, [], run, back="/limits"
    )


async def audit_page(c: Console, request: Request) -> Response:
    user = c.user(request)
    before = request.query_params.get("before") or None
    if before is not None and not reads._is_entry_id(before):
        raise HTTPException(400, "before: not an entry id")
    rows = await c.audit.page(before, AUDIT_PAGE)
    more = f"/audit?before={rows[-1]['id']}" if len(rows) == AUDIT_PAGE else None
    return c.page(request, user, "audit.html", rows=rows, more=more)


# -- the app ----------------------------------------------------------------------------------


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {k.lower() for k, _ in headers}
                for name, value in SECURITY_HEADERS.items():
                    if name.encode() not in present:
                        headers.append((name.encode(), value.encode()))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, with_headers)


def create_app(settings: Settings, client: DialogClient | None = None) -> Starlette:
    """The console for these settings; raises NoUsers when nobody may sign in. With a
    `client`, the caller owns it (tests); otherwise the app opens and closes its own."""
    console = Console(settings, client)

    def bind(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await handler(console, request)

        return endpoint

    async def error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": exc.detail}, exc.status_code, headers=exc.headers)
        html = console.templates.get_template("error.html").render(
            status=exc.status_code,
            detail=exc.detail,
            version=__version__,
            user=None,
            stream=settings.stream,
            form_token="",
        )
        return HTMLResponse(html, exc.status_code, headers=exc.headers)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await console.aclose()

    app = Starlette(
        routes=[
            Route("/", bind(overview_page)),
            Route("/api/overview", bind(overview_json)),
            Route("/api/session", bind(session_json)),
            Route("/api/letters", bind(letters_json)),
            Route("/api/message", bind(message_json)),
            Route("/message", bind(message_find)),
            Route("/message/life", bind(message_life_page)),
            Route("/api/message/life", bind(message_life_page)),
            Route("/sessions", bind(sessions_prefix)),
            Route("/api/sessions", bind(sessions_prefix)),
            Route("/session", bind(session_page)),
            Route("/session/redrive", bind(session_redrive), methods=["POST"]),
            Route("/session/hold", bind(session_hold), methods=["POST"]),
            Route("/session/cancel", bind(session_cancel), methods=["POST"]),
            Route("/letters", bind(letters_list)),
            Route("/letters/action", bind(letters_action), methods=["POST"]),
            Route("/audit", bind(audit_page)),
            Route("/limits", bind(limits_page)),
            Route("/limits/pause", bind(limits_pause), methods=["POST"]),
            Route("/limits/resume", bind(limits_resume), methods=["POST"]),
            Route("/healthz", lambda r: Response("ok\n", media_type="text/plain")),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ],
        exception_handlers={HTTPException: error},
        lifespan=lifespan,
    )
    app.add_middleware(SecurityHeaders)
    app.state.console = console
    return app
