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
    [row] = [json.loads(x) for x in run_cli(env, "tenants").stdout.splitlines()]
    assert (row["used_today"], row["reserved_now"]) == (spent, 0), "counted once, nothing held"
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
    # Spent already (committed by another worker today): nothing more is called for today.
    from dialog_worker.store import tenants

    await client.redis.hset(client.keys.usage(tenants.today()), "default:out", 10)
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
    # A key named in no setting and never set, paused by hand: listed from then on.
    paused = run_cli(env, "limits", "pause", "hand:key", "--for", "30", "--reason", "test")
    assert paused.returncode == 0, paused.stderr
    lines = run_cli(env, "limits").stdout.splitlines()
    rows = {json.loads(x)["key"]: json.loads(x) for x in lines}
    assert set(rows) == {KEY, "other:key", "hand:key"}
    assert rows[KEY]["paused_until"] > time.time() + 25
    assert rows["hand:key"]["paused_until"] > time.time() + 25
    assert rows["other:key"]["max_in_flight"] == 2
    actions = [f["action"] for _, f in await client.redis.xrange(f"{client.settings.stream}-audit")]
    assert actions == ["limit_set", "limit_pause", "limit_pause"]
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
    # `tenants` counts the wasted attempts in what the day used, as the budget check does.
    [row] = [json.loads(x) for x in run_cli(env, "tenants").stdout.splitlines()]
    assert (row["tenant"], row["used_today"]) == ("default", 45 + 30)
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


async def test_usage_reported_without_a_model_call_counts_against_the_budget_to_the_millionth(
    client: DialogClient, workers, env: dict[str, str]
):
    """A step that calls a model without a limit key reports its usage with
    `dialog_worker.usage` (10 tokens costing 0.000251): committed with the reply, counted by
    `tenants` and by the budget (15 a day: the third message ends budget_exceeded), and its
    cost kept to the millionth (0.000251 was counted as 0.00025: truncated)."""
    workers.start(1, DIALOG_ENGINE="usage_engines:ReportOnlyEngine",
                  DIALOG_TENANT_DAILY_TOKENS="15")  # fmt: skip
    first = await client.ask("u-1", "halo", timeout=30)
    assert first.outcome == "applied"
    assert first.usage == {"input_tokens": 6, "output_tokens": 4, "cost": 0.000251}
    assert (await client.tenant_usage("default"))["cost"] == 0.000251
    second = await client.ask("u-1", "lagi", timeout=30)  # 10 used < 15: it runs
    assert second.outcome == "applied"
    third = await client.ask("u-1", "sekali lagi", timeout=30)  # 20 used >= 15
    assert third.outcome == "budget_exceeded"
    listed = run_cli(env, "tenants", DIALOG_TENANT_DAILY_TOKENS="15")
    [row] = [json.loads(x) for x in listed.stdout.splitlines()]
    assert (row["used_today"], row["daily_tokens"]) == (20, 15)
    assert (await client.tenant_usage("default"))["cost"] == 0.000502


# What a setting refuses, `limits set` and `tenants set` refuse too, with the setting's own
# words: Python's int() takes "1_000" and other scripts' digits, and a value past 2**53 came
# back from Redis rounded (1e26 as 100000000000000004764729344).
REFUSED_WHOLE_NUMBERS = [
    "1_000",
    "\u0661\u0660\u0660",  # Arabic-Indic digits
    "\uff11\uff10",  # full-width digits
    "100000000000000000000000000",
    "1e26",
    "-1",
    "1.5",
    "",
    "0x10",
]


@pytest.mark.parametrize("raw", REFUSED_WHOLE_NUMBERS)
async def test_limits_set_and_tenants_set_refuse_what_the_settings_refuse_in_the_same_words(
    client: DialogClient, env: dict[str, str], raw: str
):
    setting = run_cli(env, "stats", DIALOG_TENANT_DAILY_TOKENS=raw)
    assert setting.returncode == 2, setting.stdout
    problem = setting.stderr.strip().split("DIALOG_TENANT_DAILY_TOKENS: ", 1)[1]
    limits_env = {**env, "DIALOG_MODEL_LIMITS": json.dumps({KEY: {"rpm": raw}})}
    in_settings = run_cli(limits_env, "limits")
    assert in_settings.returncode == 2 and problem in in_settings.stderr, in_settings.stderr
    for args in (
        ["limits", "set", KEY, "--rpm", raw],
        ["limits", "set", KEY, "--max-in-flight", raw],
        ["tenants", "set", "acme", "--daily-tokens", raw],
        ["tenants", "set", "acme", "--max", raw],
    ):
        done = run_cli(env, *args)
        assert done.returncode == 2, (args, done.stdout)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and problem in lines[0], (args, done.stderr)
    assert await client.redis.exists(client.keys.limit(KEY).config, client.keys.tenants) == 0


@pytest.mark.parametrize("raw", ["0", "7", " 42 ", "1000000000000"])
async def test_limits_set_and_tenants_set_take_what_the_settings_take(
    client: DialogClient, env: dict[str, str], raw: str
):
    assert run_cli(env, "stats", DIALOG_TENANT_DAILY_TOKENS=raw).returncode == 0
    done = run_cli(env, "limits", "set", KEY, "--tpm", raw)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tpm"] == int(raw)
    done = run_cli(env, "tenants", "set", "acme", "--daily-tokens", raw)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["daily_tokens"] == int(raw)


def bursts(times: list[float], gap_s: float = 0.4) -> list[list[float]]:
    """Call times grouped into bursts: a call more than ``gap_s`` after the previous starts a
    new one."""
    groups: list[list[float]] = []
    for t in sorted(times):
        if groups and t - groups[-1][-1] <= gap_s:
            groups[-1].append(t)
        else:
            groups.append([t])
    return groups


@pytest.mark.parametrize(
    "retry_after", ["0", "-3", "Wed, 21 Oct 2015 07:28:00 GMT", "soon"], ids=str
)
async def test_a_429_whose_retry_after_names_no_wait_pauses_a_floor_that_grows(
    client: DialogClient, workers, env: dict[str, str], provider: Running, retry_after: str
):
    """The provider refuses every call for 7 s with a Retry-After of 0, a negative number, a
    date in the past or one that cannot be read; 10 sessions wait on a key without limits.
    Each 429 pauses the key at least a floor (1 s, doubling with each 429 after the key
    reopened): the calls come in a few bursts (each waiting message once), further apart each
    time, not in a hot loop (64-168 calls/s before). No attempt is spent (one allowed)."""
    workers.start(1, **llm_env(env, provider), DIALOG_MAX_ATTEMPTS="1")
    await client.ask("warm", "halo", timeout=30)
    provider.provider.reset()
    provider.provider.throttle(MODEL, 7.0, retry_after)
    started = time.time()
    sessions = [f"hot{i}" for i in range(10)]
    for sid in sessions:
        await client.send(sid, "halo")
    replies = []
    async for reply in client.replies(start="0", follow=True):
        if reply.session_id in sessions:
            replies.append(reply)
        if len(replies) == len(sessions):
            break
    assert {r.outcome for r in replies} == {"applied"}, [r.outcome for r in replies]
    log = provider.provider.stats()["log"]
    refused = [e["t"] for e in log if e["status"] == 429 and e["t"] < started + 7.0]
    groups = bursts(refused)
    assert len(refused) <= 3 * len(sessions) + 3, f"{len(refused)} calls in 7 s"
    shape = [(round(g[0] - started, 2), len(g)) for g in groups]
    assert 3 <= len(groups) <= 4, shape  # at 0, 1 and 3 s (and 7 s, at the window's end)
    first_gap, second_gap = groups[1][0] - groups[0][0], groups[2][0] - groups[1][0]
    assert first_gap >= 0.9 and second_gap >= 1.6 * first_gap, shape
    assert await client.redis.xlen(client.keys.dlq) == 0
    # Listed by `limits` (a key named in no setting, paused by its provider); the calls that
    # succeeded after the incident ended the run of 429s.
    [row] = [json.loads(x) for x in run_cli(env, "limits").stdout.splitlines()]
    assert (row["key"], row["provider_429s_in_a_row"]) == (KEY, 0), row


async def test_a_providers_pause_is_capped_by_the_max_provider_pause(
    client: DialogClient, workers, env: dict[str, str], provider: Running
):
    """A provider asking for an hour (Retry-After: 3600) pauses the key for
    DIALOG_MAX_PROVIDER_PAUSE_S (2 s here), not an hour (a day before)."""
    workers.start(1, **llm_env(env, provider), DIALOG_MAX_PROVIDER_PAUSE_S="2")
    await client.ask("warm", "halo", timeout=30)
    provider.provider.throttle(MODEL, 0.5, "3600")
    started = time.time()
    reply = await client.ask("capped", "halo", timeout=30)
    assert reply.outcome == "applied"
    assert time.time() - started < 6, "answered after the cap, not after the hour"
    [row] = [json.loads(x) for x in run_cli(env, "limits").stdout.splitlines()]
    assert row["key"] == KEY and row["paused_until"] is None


@pytest.mark.parametrize(
    "limits",
    [{"rpm": 600}, {}],  # each call takes a turn (queued by tenant); no rate (turns kept)
    ids=["rate", "no-rate"],
)
async def test_limits_resume_reopens_a_paused_key_and_its_waiting_messages_go_now(
    client: DialogClient, workers, env: dict[str, str], provider: Running, limits: dict[str, int]
):
    """An operator pauses the key for 10 minutes; messages for it are handed back until then
    (no attempt spent). `limits resume` (audited) reopens it: every worker brings the messages
    it handed back to their turn within a second, and all are answered in seconds, in order."""
    workers.start(
        2,
        **llm_env(env, provider),
        DIALOG_MAX_ATTEMPTS="1",
        DIALOG_MODEL_LIMITS=json.dumps({KEY: limits}),
    )
    await client.ask("warm", "halo", timeout=30)
    paused = run_cli(env, "limits", "pause", KEY, "--for", "600", "--reason", "bill check")
    assert paused.returncode == 0, paused.stderr
    await anyio.sleep(0.3)  # past the 100 ms in which workers see the pause
    sessions = [f"r{i}" for i in range(6)]
    for text in ("satu", "dua"):
        for sid in sessions:
            await client.send(sid, text)

    async def handed_back() -> bool:
        ready = await client.redis.zrange(client.keys.ready, 0, -1, withscores=True)
        later = {m for m, score in ready if score > time.time() * 1000 + 300_000}
        return len(later) == len(sessions)

    await poll(handed_back, 20, what="every session handed back until the pause ends")
    assert len(provider.provider.stats()["log"]) == 1, "no call while paused (the warm one)"
    resumed_at = time.time()
    done = run_cli(env, "limits", "resume", KEY, "--reason", "bill is fine")
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert row["paused_until"] is None and row["resumed_early_s"] > 500
    replies = []
    with anyio.fail_after(20):  # answered after the resume, not after the pause
        async for reply in client.replies(start="0", follow=True):
            if reply.session_id in sessions:
                replies.append(reply)
            if len(replies) == 2 * len(sessions):
                break
    assert time.time() - resumed_at < 15
    assert {r.outcome for r in replies} == {"applied"}
    for sid in sessions:
        assert [r.seq for r in replies if r.session_id == sid] == [1, 2]
    audit = [f for _, f in await client.redis.xrange(f"{client.settings.stream}-audit")]
    assert [(a["action"], a["reason"]) for a in audit] == [
        ("limit_pause", "bill check"),
        ("limit_resume", "bill is fine"),
    ]
    again = run_cli(env, "limits", "resume", KEY, "--reason", "twice")
    assert again.returncode == 0 and json.loads(again.stdout)["resumed_early_s"] == 0
    bad = run_cli(env, "limits", "resume", KEY)
    assert bad.returncode == 2 and "--reason" in bad.stderr


async def test_calls_that_fail_in_an_outage_give_their_reservation_back(
    client: DialogClient, workers, env: dict[str, str], provider: Running
):
    """The provider is down (503): one message fails its 5 attempts, each call refused without
    using a token, so each gives its reservation back at once. The tenant's budget (three
    estimates) is untouched: `tenants` shows 0 used, and once the provider is back the next
    message is answered (before: 5 x the estimate spent, budget_exceeded for the day)."""
    from llm_engine import conversation, estimate

    budget = 3 * estimate(conversation({"history": []}, "halo"), 8) + 5
    workers.start(
        1,
        **llm_env(env, provider),
        DIALOG_TENANT_DAILY_TOKENS=str(budget),
        DIALOG_BACKOFF_BASE_MS="10",
        DIALOG_BACKOFF_MAX_MS="20",
    )
    provider.provider.fail(MODEL, 120.0)
    first = await client.ask("out-1", "halo", timeout=30)
    assert first.outcome == "dead_lettered"
    assert [e["status"] for e in provider.provider.stats()["log"]] == [503] * 5
    listed = run_cli(env, "tenants", DIALOG_TENANT_DAILY_TOKENS=str(budget))
    [row] = [json.loads(x) for x in listed.stdout.splitlines()]
    assert (row["tenant"], row["used_today"], row["daily_tokens"]) == ("default", 0, budget)
    assert row["reserved_now"] == 0, "nothing held: each failed call gave its estimate back"
    provider.provider.fail(MODEL, 0.0)
    second = await client.ask("out-2", "halo", timeout=30)
    assert second.outcome == "applied", "the outage spent none of the budget"


async def test_a_budget_set_late_counts_what_the_day_used_before_it(
    client: DialogClient, workers, env: dict[str, str]
):
    """No budget in the morning: 30 messages use 450 tokens. At noon `tenants set default
    --daily-tokens 360`: the next message ends budget_exceeded without a step, and `tenants`
    shows the 450 used today that the check sees."""
    workers.start(1, DIALOG_ENGINE="usage_engines:UsageEngine")
    sessions = [f"late-{i}" for i in range(30)]
    for sid in sessions:
        await client.send(sid, "halo")
    applied = 0
    with anyio.fail_after(60):
        async for reply in client.replies(start="0", follow=True):
            applied += reply.session_id in sessions and reply.outcome == "applied"
            if applied == len(sessions):
                break
    done = run_cli(env, "tenants", "set", "default", "--daily-tokens", "360")
    assert done.returncode == 0, done.stderr
    await anyio.sleep(1.2)  # workers read the tenants' settings once a second
    late = await client.ask("late-x", "pre halo", timeout=30)
    assert late.outcome == "budget_exceeded" and late.usage is None, "ended before its step"
    [row] = [json.loads(x) for x in run_cli(env, "tenants").stdout.splitlines()]
    assert (row["used_today"], row["daily_tokens"]) == (450, 360)


async def test_a_reader_sees_waiting_for_the_rate_then_the_answer(
    client: DialogClient, workers, env: dict[str, str], provider: Running
):
    """rpm 20: one call every 3 s. The second message's call waits for its turn inside its
    step (up to DIALOG_MODEL_CALL_MAX_WAIT_MS): its reader is told so first (`waiting`, reason
    `rate`, with when it expects to go), then gets the answer, with no `reset`."""
    workers.start(
        1,
        **llm_env(env, provider),
        DIALOG_MODEL_LIMITS=json.dumps({KEY: {"rpm": 20}}),
        DIALOG_MODEL_CALL_MAX_WAIT_MS="5000",
    )
    await client.ask("warm", "halo", timeout=30)
    sent_at_ms = time.time() * 1000
    events = [e async for e in client.ask_stream("w1", "halo", timeout=30)]
    kinds = [e.kind for e in events]
    assert kinds[0] == "waiting" and kinds[-1] == "end", kinds
    assert "delta" in kinds and "reset" not in kinds and kinds.count("waiting") == 1, kinds
    waiting = events[0]
    assert waiting.data["reason"] == "rate"
    assert waiting.cursor is None, "nothing was shown yet: the wait takes no position"
    assert sent_at_ms < waiting.data["until_ms"] < sent_at_ms + 3_500
    assert events[-1].outcome == "applied" and events[-1].text
    assert waiting.as_dict()["data"] == waiting.data and "event_kind" not in waiting.as_dict()


async def test_a_reader_sees_waiting_for_a_paused_key_until_it_reopens_then_the_answer(
    client: DialogClient, workers, env: dict[str, str], provider: Running
):
    """The key is paused for 10 minutes: the message goes back to wait outside its step, and
    its reader is told at once (`waiting`, reason `paused`, `until_ms` the pause's end). Once
    an operator reopens the key, the reader gets the answer, of the same attempt number (no
    `reset`: nothing was shown); no attempt was spent (DIALOG_MAX_ATTEMPTS=1)."""
    workers.start(
        1,
        **llm_env(env, provider),
        DIALOG_MAX_ATTEMPTS="1",
        DIALOG_MODEL_LIMITS=json.dumps({KEY: {"rpm": 600}}),
    )
    await client.ask("warm", "halo", timeout=30)
    paused = run_cli(env, "limits", "pause", KEY, "--for", "600", "--reason", "bill check")
    assert paused.returncode == 0, paused.stderr
    await anyio.sleep(0.3)  # past the 100 ms in which workers see the pause
    events = []
    told = anyio.Event()

    async def read() -> None:
        async for event in client.ask_stream("p1", "halo", timeout=60):
            events.append(event)
            if event.kind == "waiting":
                told.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        with anyio.fail_after(20):
            await told.wait()
        waiting = next(e for e in events if e.kind == "waiting")
        assert waiting.data["reason"] == "paused"
        assert waiting.data["until_ms"] > time.time() * 1000 + 500_000
        assert [e.kind for e in events] == ["waiting"], "nothing else while it waits"
        done = run_cli(env, "limits", "resume", KEY, "--reason", "bill is fine")
        assert done.returncode == 0, done.stderr
    kinds = [e.kind for e in events]
    assert kinds[0] == "waiting" and kinds[-1] == "end" and "reset" not in kinds, kinds
    assert events[-1].outcome == "applied" and events[-1].text
    # The attempt that went back kept its number (its call finds the turn kept for it).
    assert {e.attempt for e in events} == {waiting.attempt}


async def test_a_message_handed_back_for_a_later_turn_tells_its_reader_and_gets_that_turn(
    client: DialogClient, workers, env: dict[str, str], provider: Running
):
    """rpm 20 (a call every 3 s) and a step waits at most 500 ms: the second message's turn is
    about 3 s away, so it goes back to wait for it (RESERVED). Its reader is told (`waiting`,
    `rate`, no position), and the message comes back with the same attempt number, so its
    call finds the turn kept for it: answered in about 3 s, not queued again at the end of
    the key's line (each return a turn later, each time further away)."""
    workers.start(
        1,
        **llm_env(env, provider),
        DIALOG_MODEL_LIMITS=json.dumps({KEY: {"rpm": 20}}),
        DIALOG_MODEL_CALL_MAX_WAIT_MS="500",
    )
    await client.ask("warm", "halo", timeout=30)
    started = time.monotonic()
    events = [e async for e in client.ask_stream("h1", "halo", timeout=30)]
    took = time.monotonic() - started
    kinds = [e.kind for e in events]
    assert kinds[0] == "waiting" and kinds[-1] == "end" and "reset" not in kinds, kinds
    assert events[0].data["reason"] == "rate" and events[0].cursor is None
    assert events[-1].outcome == "applied" and {e.attempt for e in events} == {1}
    assert took < 5.5, f"answered after {took:.1f} s: its kept turn was lost"
    calls = [e for e in provider.provider.stats()["log"] if e["status"] == 200]
    assert len(calls) == 2, "one call each, none charged twice"


async def test_a_tenants_lone_message_is_not_behind_anothers_calls_at_the_key(
    client: DialogClient, workers, env: dict[str, str], provider: Running
):
    """The key allows 10 calls a second; tenant a's 100 messages (10 s of the key's turns) are
    waiting for it when tenant b sends three lone messages, half a second apart: each of b's
    is answered within a couple of the key's turns plus its step, not after a's backlog (no
    `tenants set`: the tenant field is enough). Every message once, none dead-lettered."""
    workers.start(
        2,
        **llm_env(env, provider),
        DIALOG_CONCURRENCY="8",
        DIALOG_MODEL_LIMITS=json.dumps({KEY: {"rpm": 600}}),
    )
    await client.ask("warm", "halo", timeout=30)
    for i in range(100):
        await client.send(f"a-{i}", "halo", tenant="a")
    await anyio.sleep(1.5)  # a's calls wait at the key
    waits = []
    for i in range(3):
        sent = time.monotonic()
        reply = await client.ask(f"b-{i}", "halo", tenant="b", timeout=30)
        assert reply.outcome == "applied"
        waits.append(time.monotonic() - sent)
        await anyio.sleep(0.5)
    # a's backlog still takes seconds: b's three went through it, each in a few turns (the
    # bound leaves room for a loaded machine: first come, first served took 8 s and more).
    assert max(waits) < 3.0, waits
    done: set[str] = set()
    async for reply in client.replies(start="0", follow=True):
        if reply.session_id.startswith("a-"):
            assert reply.outcome == "applied" and reply.session_id not in done
            done.add(reply.session_id)
        if len(done) == 100:
            break
    assert await client.redis.xlen(client.keys.dlq) == 0
