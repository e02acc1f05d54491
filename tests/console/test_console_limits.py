"""The console's limits page: the limit keys and the tenants' usage of the day, read-only for a
viewer; an operator pauses a key for every worker with a reason, audited."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from console_support import OPERATOR, VIEWER, basic, form_token

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.store import tenants
from dialog_worker.store.keys import Keys
from dialog_worker.store.limits import LimitStore
from dialog_worker.store.scripts import Scripts

pytestmark = pytest.mark.integration

OP = basic(OPERATOR)
VIEW = basic(VIEWER)


async def test_the_limits_page_shows_keys_and_tenants_and_an_operator_pauses_a_key(
    http: httpx.AsyncClient, client: DialogClient, console_settings
):
    store = LimitStore(client.redis, Scripts.register(client.redis), console_settings)
    await store.set("openai:gpt", rpm=60, tpm=1000)
    keys = Keys.from_settings(console_settings)
    await tenants.set_settings(client.redis, keys, "acme", daily_tokens=5000)
    await client.redis.hset(keys.usage(tenants.today()), mapping={"acme:in": 40, "acme:out": 2})

    viewer = await http.get("/limits", headers=VIEW)
    assert viewer.status_code == 200
    assert 'data-key="openai:gpt"' in viewer.text and "pause-form" not in viewer.text
    assert 'data-tenant="acme"' in viewer.text and '<td class="used">42</td>' in viewer.text
    refused = await http.post(
        "/limits/pause", headers=VIEW, data={"key": "openai:gpt", "for": "5m", "reason": "x"}
    )
    assert refused.status_code == 403

    page = await http.get("/limits", headers=OP)
    assert "pause-form" in page.text
    done = await http.post(
        "/limits/pause",
        headers=OP,
        data={"key": "openai:gpt", "for": "5m", "reason": "provider incident",
              "form_token": form_token(page.text)},
    )  # fmt: skip
    assert done.status_code == 200, done.text
    view = await store.view("openai:gpt")
    assert view["paused_until"] > time.time() + 290
    assert "provider incident" in view["pause_reason"]
    entries = [f for _, f in await client.redis.xrange(f"{console_settings.stream}-audit")]
    assert [(e["action"], e["outcome"], e["who"]) for e in entries] == [
        ("pause_limit_key", "requested", OPERATOR[0]),
        ("pause_limit_key", "done", OPERATOR[0]),
    ]
    assert entries[0]["reason"] == "provider incident"
    no_reason = await http.post(
        "/limits/pause",
        headers=OP,
        data={"key": "openai:gpt", "for": "5m", "reason": " ", "form_token": form_token(page.text)},
    )
    assert no_reason.status_code == 400
    assert json.loads(entries[1]["detail"])["done"] == 1


async def test_an_operator_resumes_a_paused_key_and_the_overview_lists_paused_keys(
    http: httpx.AsyncClient, client: DialogClient, console_settings
):
    """A key paused by its provider (named in no setting) is on the overview with its reason
    and reopening time; a viewer cannot resume it (the server refuses); an operator's Resume
    reopens it for every worker, audited with its reason."""
    store = LimitStore(client.redis, Scripts.register(client.redis), console_settings)
    await store.provider_pause("anthropic:claude", 300.0, "429 from the provider")
    overview = await http.get("/", headers=VIEW)
    assert overview.status_code == 200
    row = overview.text.split('id="paused-keys"', 1)[1].split("</table>", 1)[0]
    assert 'data-key="anthropic:claude"' in row and "429 from the provider" in row
    reopens = time.strftime("%Y-%m-%d %H:%M", time.gmtime(time.time() + 300))
    assert reopens[:13] in row, "its reopening time (UTC)"

    viewer = await http.get("/limits", headers=VIEW)
    assert "resume-form" not in viewer.text
    refused = await http.post(
        "/limits/resume", headers=VIEW, data={"key": "anthropic:claude", "reason": "x"}
    )
    assert refused.status_code == 403
    assert (await store.view("anthropic:claude"))["paused_until"] is not None

    page = await http.get("/limits", headers=OP)
    assert "resume-form" in page.text
    done = await http.post(
        "/limits/resume",
        headers=OP,
        data={"key": "anthropic:claude", "reason": "provider is back",
              "form_token": form_token(page.text)},
    )  # fmt: skip
    assert done.status_code == 200, done.text
    assert (await store.view("anthropic:claude"))["paused_until"] is None
    entries = [f for _, f in await client.redis.xrange(f"{console_settings.stream}-audit")]
    assert [(e["action"], e["outcome"], e["reason"]) for e in entries] == [
        ("resume_limit_key", "requested", "provider is back"),
        ("resume_limit_key", "done", "provider is back"),
    ]
    after = await http.get("/", headers=VIEW)
    assert 'data-key="anthropic:claude"' not in after.text.split('id="paused-keys"', 1)[1]
