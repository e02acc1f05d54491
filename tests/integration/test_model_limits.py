"""Model-provider limits with real workers and the fake provider (a real HTTP server that
enforces rpm/tpm and answers 429 with Retry-After): a 429 pauses the key for every worker and
costs no attempt, usage is committed with the reply, budgets end messages budget_exceeded
without a call."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import anyio
import pytest
from examples_path import with_examples
from redis_server import wait_until_async as poll
from worker_procs import run_cli

from dialog_worker import DialogClient
from dialog_worker.bench.fake_provider import Running

pytestmark = pytest.mark.integration

MODEL = "m"
KEY = f"llm:{MODEL}"


@pytest.fixture
def provider() -> Iterator[Running]:
    with Running(output_tokens=8, latency_ms=30) as running:
        yield running


def llm_env(env: dict[str, str], provider: Running, **extra: str) -> dict[str, str]:
    return {
        **with_examples(env),
        "DIALOG_ENGINE": "llm_engine:LLMEngine",
        "LLM_BASE_URL": f"{provider.url}/v1",
        "LLM_MODEL": MODEL,
        "LLM_MAX_TOKENS": "8",
        **extra,
    }


async def test_a_429_pauses_the_key_for_every_worker_and_costs_no_attempt(
    client: DialogClient, workers, env: dict[str, str], provider: Running
):
    """One attempt only (DIALOG_MAX_ATTEMPTS=1): a message that spent one on a 429 would be
    dead-lettered. The provider answers 429 (Retry-After: 2) for two seconds; the first 429
    pauses the key in Redis, so no worker calls it again until then, and every message is
    applied once, in its session's order."""
    workers.start(
        2,
        **llm_env(env, provider),
        DIALOG_MAX_ATTEMPTS="1",
        DIALOG_MODEL_LIMITS=json.dumps({KEY: {"rpm": 60_000}}),
    )
    await client.ask("warm", "halo", timeout=30)  # both workers are up, the key is known
    provider.provider.reset()
    provider.provider.throttle(MODEL, 2.0)
    sessions = [f"s{i}" for i in range(8)]
    await client.send(sessions[0], "satu")

    async def limited() -> bool:
        return any(e["status"] == 429 for e in provider.provider.stats()["log"])

    await poll(limited, 10, what="the first 429")
    await anyio.sleep(0.3)  # past the 100 ms in which the pause reaches every worker
    # Sessions that had not called yet: they must wait for the pause too.
    for text in ("satu", "dua", "tiga"):
        for sid in sessions:
            if (sid, text) != (sessions[0], "satu"):
                await client.send(sid, text)
    replies = []
    async for reply in client.replies(start="0", follow=True):
        if reply.session_id in sessions:
            replies.append(reply)
        if len(replies) == 3 * len(sessions):
            break
    assert {r.outcome for r in replies} == {"applied"}, [r.outcome for r in replies]
    for sid in sessions:
        seqs = [r.seq for r in replies if r.session_id == sid]
        assert seqs == [1, 2, 3], (sid, seqs)
        state = await client.state(sid)
        assert state is not None
        assert [t["user"] for t in state["history"]] == ["satu", "dua", "tiga"]
    log = provider.provider.stats()["log"]
    first_429 = min(e["t"] for e in log if e["status"] == 429)
    pause_end = first_429 + 2.0
    during = [e for e in log if first_429 + 0.1 < e["t"] < pause_end - 0.05]
    # Calls granted before the pause reached Redis arrive in the first moments; after that, a
    # herd of retries would show here: none.
    assert during == [], "no worker called the paused key (besides calls already in flight)"
    assert await client.redis.xlen(client.keys.dlq) == 0


async def test_usage_is_committed_with_the_reply_per_session_and_per_tenant(
    client: DialogClient, workers, env: dict[str, str], provider: Running
):
    workers.start(1, **llm_env(env, provider), DIALOG_TENANT_PATTERN="^([a-z]+)-")
    first = await client.ask("acme-1", "halo", timeout=30)
    second = await client.ask("acme-1", "apa kabar", timeout=30)
    assert first.outcome == second.outcome == "applied"
    assert first.usage is not None and second.usage is not None
    assert first.usage["output_tokens"] == 8 and first.usage["input_tokens"] > 0
    assert first.usage["cost"] is None
    total_in = first.usage["input_tokens"] + second.usage["input_tokens"]
    session = await client.usage("acme-1")
    assert (session["input_tokens"], session["output_tokens"], session["calls"]) == (
        total_in,
        16,
        2,
    )
    assert session["wasted"]["calls"] == 0
    tenant = await client.tenant_usage("acme")
    assert (tenant["input_tokens"], tenant["output_tokens"], tenant["calls"]) == (total_in, 16, 2)
    assert (await client.tenant_usage("other"))["calls"] == 0
    counts = provider.provider.stats()["models"][MODEL]
    assert counts["prompt_tokens"] == total_in and counts["completion_tokens"] == 16


async def test_a_spent_budget_ends_messages_budget_exceeded_without_a_call(
    client: DialogClient, workers, env: dict[str, str], provider: Running
):
    """A daily budget a little above the first call's estimate: that call is made; the
    second's estimate would pass the budget with what the first spent, so model_call refuses
    it and no call is made. None is dead-lettered, and raising the budget (tenants set,
    audited) lets the tenant go on."""
    from llm_engine import conversation, estimate

    first_estimate = estimate(conversation({"history": []}, "halo"), 8)
    budget = first_estimate + 5
    workers.start(
        1,
        **llm_env(env, provider),
        DIALOG_TENANT_DAILY_TOKENS=str(budget),
        DIALOG_BUDGET_REPLY="Kuota habis.",
    )
    first = await client.ask("b-1", "halo", timeout=30)
    assert first.outcome == "applied" and first.usage is not None
    spent = first.usage["input_tokens"] + first.usage["output_tokens"]
    assert spent < budget
    second = await client.ask("b-1", "lagi", timeout=30)  # spent + its estimate > budget
    assert (second.outcome, second.text) == ("budget_exceeded", "Kuota habis.")
    assert len(provider.provider.stats()["log"]) == 1, "no call for the refused message"
    state = await client.state("b-1")
    assert state is not None and state["history"][-1].get("budget_exceeded") is True
    done = run_cli(env, "tenants", "set", "default", "--daily-tokens", "100000")
    assert done.returncode == 0, done.stderr
    await anyio.sleep(1.2)  # workers read the tenants' settings once a second
    third = await client.ask("b-1", "lagi", timeout=30)
    assert third.outcome == "applied"
    assert await client.redis.xlen(client.keys.dlq) == 0
    [audit] = [
        f
        for _, f in await client.redis.xrange(f"{client.settings.stream}-audit")
        if f["action"] == "tenant_set"
    ]
    assert audit["target"] == "default" and json.loads(audit["detail"])["daily_tokens"] == 100000


async def test_a_message_whose_tenant_spent_its_budget_ends_before_its_step(
    client: DialogClient, workers, env: dict[str, str]
):
    """The step of a "pre" message reports usage before its model_call: had it run, its
    usage would be committed with the budget_exceeded reply."""
    workers.start(1, DIALOG_ENGINE="usage_engines:UsageEngine", DIALOG_TENANT_DAILY_TOKENS="10")
    # Spent already (another worker's calls of the day): nothing more is called for today.
    from dialog_worker.store import tenants

    await client.redis.hset(client.keys.budget("default", tenants.today()).meter, "spent", 10)
    reply = await client.ask("c-1", "pre halo", timeout=30)
    assert reply.outcome == "budget_exceeded" and reply.usage is None, "no step ran"
    again = await client.ask("c-1", "pre halo", msg_id=reply.msg_id, timeout=30)
    assert again.outcome == "budget_exceeded", "its msg_id was freed: sent again, it is tried"
    assert (await client.usage("c-1"))["calls"] == 0
    found = await client.cancel("c-1", reply.msg_id)
    assert (found.status, found.outcome) == ("finished", "budget_exceeded")


async def test_limits_cli_lists_sets_and_pauses_keys_audited(
    client: DialogClient, env: dict[str, str]
):
    env = {**env, "DIALOG_MODEL_LIMITS": json.dumps({KEY: {"rpm": 60, "tpm": 1000}})}
    listed = run_cli(env, "limits")
    assert listed.returncode == 0, listed.stderr
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (row["key"], row["rpm"], row["tpm"], row["max_in_flight"]) == (KEY, 60, 1000, 0)
    assert (row["in_flight"], row["paused_until"]) == (0, None)
    done = run_cli(env, "limits", "set", "other:key", "--rpm", "5", "--max-in-flight", "2")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rpm"] == 5
    paused = run_cli(env, "limits", "pause", KEY, "--for", "30", "--reason", "provider incident")
    assert paused.returncode == 0, paused.stderr
    lines = run_cli(env, "limits").stdout.splitlines()
    rows = {json.loads(x)["key"]: json.loads(x) for x in lines}
    assert set(rows) == {KEY, "other:key"}
    assert rows[KEY]["paused_until"] > time.time() + 25
    assert rows["other:key"]["max_in_flight"] == 2
    actions = [f["action"] for _, f in await client.redis.xrange(f"{client.settings.stream}-audit")]
    assert actions == ["limit_set", "limit_pause"]
    bad = run_cli(env, "limits", "pause", KEY, "--for", "30")
    assert bad.returncode == 2 and "--reason" in bad.stderr
    bad = run_cli(env, "limits", "set", KEY)
    assert bad.returncode == 2 and "at least one" in bad.stderr


async def test_an_attempt_that_did_not_commit_counts_its_usage_as_wasted_only(
    client: DialogClient, workers, env: dict[str, str]
):
    """A step that reported usage and then failed (retried), and one whose call was refused
    with a 429 (handed back): their usage is counted apart, as wasted, never as committed."""
    [worker] = workers.start(
        1,
        metrics=True,
        DIALOG_ENGINE="usage_engines:UsageEngine",
        DIALOG_BACKOFF_BASE_MS="20",
        DIALOG_BACKOFF_MAX_MS="50",
        DIALOG_MAX_ATTEMPTS="2",
    )
    failed = await client.ask("w-1", "fail-once please", timeout=30)
    limited = await client.ask("w-1", "limit me", timeout=30)
    threaded = await client.ask("w-1", "thread step", timeout=30)
    for reply in (failed, limited, threaded):
        assert reply.outcome == "applied"
        assert reply.usage == {"input_tokens": 10, "output_tokens": 5, "cost": 0.01}
    session = await client.usage("w-1")
    assert (session["input_tokens"], session["output_tokens"], session["calls"]) == (30, 15, 3)
    assert session["cost"] == pytest.approx(0.03)
    assert session["wasted"] == {"input_tokens": 20, "output_tokens": 10, "cost": 0.02,
                                 "calls": 2}  # fmt: skip
    tenant = await client.tenant_usage("default")
    assert (tenant["input_tokens"], tenant["calls"]) == (30, 3)
    assert (tenant["wasted"]["input_tokens"], tenant["wasted"]["calls"]) == (20, 2)
    state = await client.state("w-1")
    assert state is not None and state["usage"]["calls"] == 3
    metrics = worker.metrics_text()
    assert 'dialog_llm_tokens_total{kind="input",model="m"} 50.0' in metrics  # 30 + 20 wasted
    assert 'dialog_llm_rate_limited_total{key="k"} 1.0' in metrics
    assert 'dialog_retries_total{reason="rate_limited"} 1.0' in metrics


async def test_a_sessions_daily_budget_ends_its_messages_and_no_other_sessions(
    client: DialogClient, workers, env: dict[str, str]
):
    workers.start(1, DIALOG_ENGINE="usage_engines:UsageEngine", DIALOG_SESSION_DAILY_TOKENS="20")
    first = await client.ask("sb-1", "halo", timeout=30)
    assert first.outcome == "applied"  # 15 tokens of its 20
    second = await client.ask("sb-1", "lagi", timeout=30)  # 15 + an estimate of 15 > 20
    assert second.outcome == "budget_exceeded"
    other = await client.ask("sb-2", "halo", timeout=30)
    assert other.outcome == "applied", "another session's budget is its own"
    done = run_cli(env, "tenants")
    assert done.returncode == 0, done.stderr
    [row] = [json.loads(line) for line in done.stdout.splitlines()]
    assert (row["tenant"], row["used_today"], row["daily_tokens"]) == ("default", 30, 0)
