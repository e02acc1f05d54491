"""GET /openapi.json: built from the app's own routes, complete (a route without a description
fails here), and internally consistent (every $ref resolves)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.responses import JSONResponse
from starlette.routing import Route

from dialog_worker.config import load_settings
from dialog_worker.gateway import openapi
from dialog_worker.gateway.app import create_app


def gateway(**extra: Any) -> Any:
    return create_app(load_settings(environ={}), "t0ken", **extra)


def test_every_route_of_the_gateway_is_described():
    app = gateway()
    assert openapi.undescribed(list(app.routes)) == []
    document = openapi.document(list(app.routes))
    served = {(m.lower(), p) for m, p, _ in openapi.endpoints(list(app.routes))}
    listed = {(m, p) for p, ops in document["paths"].items() for m in ops}
    assert listed == served
    # The protocol's routes are there, under their mount.
    assert ("post", "/langgraph/threads/{thread_id}/runs/stream") in listed
    assert ("post", "/sessions/{session_id}/messages") in listed


def test_a_route_added_without_a_description_is_reported():
    async def mine(request: Any) -> JSONResponse:
        return JSONResponse({})

    app = gateway(extra_routes=[Route("/mine", mine, methods=["GET", "POST"])])
    assert openapi.undescribed(list(app.routes)) == ["GET /mine", "POST /mine"]
    listed = openapi.document(list(app.routes))["paths"]["/mine"]
    assert listed["get"]["summary"] == "(not described)"


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_every_reference_resolves_and_operations_have_unique_ids():
    document = openapi.document(list(gateway().routes))
    schemas = document["components"]["schemas"]
    refs = _refs(document)
    assert refs
    assert {r.removeprefix("#/components/schemas/") for r in refs} <= set(schemas)
    ids = [op["operationId"] for ops in document["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    run = document["paths"]["/langgraph/threads/{thread_id}/runs/stream"]["post"]
    body = run["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/RunCreate"}
    modes = schemas["RunCreate"]["properties"]["stream_mode"]
    assert "messages-tuple" in str(modes) and "debug" not in str(modes)


@pytest.mark.asyncio
async def test_the_document_is_served_without_a_token():
    app = gateway()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gw"
    ) as http:
        answer = await http.get("/openapi.json")
        refused = await http.get("/langgraph/info")
    assert answer.status_code == 200
    assert answer.json()["openapi"] == "3.1.0"
    assert answer.json()["paths"]["/healthz"]["get"]["security"] == []
    assert refused.status_code == 401
