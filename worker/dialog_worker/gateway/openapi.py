"""``GET /openapi.json``: the gateway's OpenAPI 3.1 document, built from the app's own routes.

Each route module describes its handlers where they are written (`operation`, a decorator
that records the description in this module's registry; `describe` for a handler written
elsewhere), with pydantic models for bodies and answers. The document walks the app's routes
(mounts included) and takes each one's description from the registry, so a route cannot be
served and left out: one without a description is listed as such (`undescribed`), and the
suite fails on it. Nothing here validates requests: handlers keep their own checks (a bad body
is a 400 with ``{"error": ...}``, never a 422).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from dialog_worker.version import __version__

REF = "#/components/schemas/{model}"
EVENT_STREAM = "text/event-stream"
# Routes anyone may call (no token).
PUBLIC = frozenset({"/healthz", "/openapi.json", "/metrics"})

Handler = TypeVar("Handler", bound=Callable[..., Any])


class Error(BaseModel):
    """Every refusal: 4xx (bad input, a wrong token) or 503 (Redis out of reach)."""

    error: str


@dataclasses.dataclass(frozen=True, slots=True)
class Operation:
    """One route's description. ``responses``: status -> a pydantic model (or ``list[Model]``),
    ``text/event-stream``, or None (no body); refusals are added by the document. ``query``:
    query parameter -> what it does."""

    tag: str
    summary: str
    body: Any = None
    responses: Mapping[int, Any] = dataclasses.field(default_factory=dict)
    query: Mapping[str, str] = dataclasses.field(default_factory=dict)
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)


_BY_HANDLER: dict[Callable[..., Any], Operation] = {}


def operation(
    tag: str,
    summary: str,
    *,
    body: Any = None,
    responses: Mapping[int, Any] | None = None,
    query: Mapping[str, str] | None = None,
    headers: Mapping[str, str] | None = None,
) -> Callable[[Handler], Handler]:
    """Describes the decorated route handler (see `Operation`)."""

    def register(handler: Handler) -> Handler:
        describe(
            handler, Operation(tag, summary, body, responses or {}, query or {}, headers or {})
        )
        return handler

    return register


def describe(handler: Callable[..., Any], described: Operation) -> None:
    _BY_HANDLER[handler] = described


def endpoints(routes: list[BaseRoute], prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """Every (method, path, handler) the routes serve, mounts included (HEAD, which Starlette
    adds to every GET, left out)."""
    for route in routes:
        if isinstance(route, Mount):
            yield from endpoints(list(route.routes), prefix + route.path)
        elif isinstance(route, Route):
            for method in sorted(route.methods or ()):
                if method != "HEAD":
                    yield method, prefix + route.path, route.endpoint


def undescribed(routes: list[BaseRoute]) -> list[str]:
    return [f"{m} {p}" for m, p, handler in endpoints(routes) if handler not in _BY_HANDLER]


def document(routes: list[BaseRoute]) -> dict[str, Any]:
    components: dict[str, Any] = {}
    paths: dict[str, dict[str, Any]] = {}
    for method, path, handler in endpoints(routes):
        template = re.sub(r"\{(\w+)(:[^}]*)?\}", r"{\1}", path)
        described = _BY_HANDLER.get(handler)
        paths.setdefault(template, {})[method.lower()] = (
            _operation(template, method, handler, described, components)
            if described is not None
            else {"summary": "(not described)", "responses": {"default": {"description": ""}}}
        )
    components.setdefault("Error", _schema(Error, "serialization", components))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "dialog-worker gateway",
            "version": __version__,
            "description": "The HTTP gateway of dialog-worker (docs/http.md): its own routes, "
            "and the LangGraph Agent Protocol subset under /langgraph.",
        },
        "paths": paths,
        "components": {
            "schemas": dict(sorted(components.items())),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
                "accessToken": {"type": "apiKey", "in": "query", "name": "access_token"},
            },
        },
        "security": [{"bearer": []}, {"apiKey": []}, {"accessToken": []}],
    }


def _operation(
    path: str,
    method: str,
    handler: Callable[..., Any],
    described: Operation,
    components: dict[str, Any],
) -> dict[str, Any]:
    parameters: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in re.findall(r"\{(\w+)\}", path)
    ]
    parameters += [
        {
            "name": name,
            "in": "query",
            "required": False,
            "description": text,
            "schema": {"type": "string"},
        }
        for name, text in described.query.items()
    ]
    parameters += [
        {
            "name": name,
            "in": "header",
            "required": False,
            "description": text,
            "schema": {"type": "string"},
        }
        for name, text in described.headers.items()
    ]
    doc: dict[str, Any] = {
        "operationId": f"{described.tag.lower().replace(' ', '_')}_{handler.__name__}",
        "tags": [described.tag],
        "summary": described.summary,
        "parameters": parameters,
        "responses": _responses(described.responses, components),
    }
    if handler.__doc__:
        doc["description"] = " ".join(handler.__doc__.split())
    if described.body is not None:
        doc["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": _schema(described.body, "validation", components)}
            },
        }
    if path in PUBLIC:
        doc["security"] = []
    return doc


def _responses(responses: Mapping[int, Any], components: dict[str, Any]) -> dict[str, Any]:
    shown: dict[str, Any] = {}
    for status, answer in sorted(responses.items()):
        if answer is None:
            shown[str(status)] = {"description": "no body" if status == 204 else ""}
        elif answer == EVENT_STREAM:
            shown[str(status)] = {
                "description": "server-sent events",
                "content": {EVENT_STREAM: {"schema": {"type": "string"}}},
            }
        else:
            shown[str(status)] = {
                "description": "",
                "content": {
                    "application/json": {"schema": _schema(answer, "serialization", components)}
                },
            }
        if 400 <= status:
            shown[str(status)]["content"] = {"application/json": {"schema": _ref(Error)}}
    error = {"description": "", "content": {"application/json": {"schema": _ref(Error)}}}
    for refusal in ("400", "401", "403", "503"):
        shown.setdefault(refusal, error)
    return shown


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _schema(annotation: Any, mode: Any, components: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a model or type, its models moved into ``components``."""
    schema = TypeAdapter(annotation).json_schema(ref_template=REF, mode=mode)
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    if isinstance(annotation, type) and (
        issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)
    ):
        components.setdefault(annotation.__name__, schema)
        return {"$ref": REF.format(model=annotation.__name__)}
    return schema


@operation("Gateway", "This document: every route of the gateway", responses={200: None})
async def openapi_json(request: Request) -> Response:
    built = getattr(request.app.state, "openapi", None)
    if built is None:
        built = request.app.state.openapi = document(list(request.app.routes))
    return JSONResponse(built)
