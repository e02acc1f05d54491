"""Operator configuration (issue 4): config/prometheus.yml, config/alerts.yml (with its
promtool unit tests in config/alerts.test.yml), the Grafana dashboard and docs/runbook.md are
checked against the product itself: promtool validates and unit-tests the rules, every metric
name they use exists in dialog_worker.metrics, every runbook command parses with the real CLI
parser, and a real Prometheus server scrapes a real worker with the alert rules loaded."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from redis_server import free_port

from dialog_worker.cli import _parser
from dialog_worker.metrics import Metrics

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "config"
PROMETHEUS_YML = CONFIG / "prometheus.yml"
ALERTS_YML = CONFIG / "alerts.yml"
ALERTS_TEST_YML = CONFIG / "alerts.test.yml"
DASHBOARD = CONFIG / "grafana" / "dialog-worker.json"
PROVISIONING = CONFIG / "grafana" / "provisioning"
RUNBOOK = REPO / "docs" / "runbook.md"

METRIC_NAME = re.compile(r"\bdialog_[a-z_]+")
JOB = "dialog-worker"

# Contract section 7: the dashboard shows every one of these.
CONTRACT_METRICS = {
    "dialog_messages_total",
    "dialog_retries_total",
    "dialog_lock_contended_total",
    "dialog_reclaimed_total",
    "dialog_fencing_rejections_total",
    "dialog_lease_renewals_total",
    "dialog_processing_seconds_bucket",
    "dialog_end_to_end_seconds_bucket",
    "dialog_stream_length",
    "dialog_group_lag",
    "dialog_pending",
    "dialog_oldest_pending_age_seconds",
    "dialog_delayed",
    "dialog_dlq_length",
    "dialog_in_flight",
}

REQUIRED_ALERT_METRICS = {
    "dialog_oldest_pending_age_seconds",
    "dialog_dlq_length",
    "dialog_retries_total",
    "dialog_fencing_rejections_total",
    "dialog_group_lag",
}

RUNBOOK_SECTIONS = {
    "backlog-rising",
    "one-session-stuck",
    "lock-stuck",
    "poison-message",
    "dlq-replay",
    "redis-down",
    "fencing-rejections",
}

RUNBOOK_PLACEHOLDERS = {
    "SESSION_ID": "session_123",
    "DLQ_ID": "1700000000000-0",
    "ENTRY_ID": "1700000000000-0",
    "TEXT": "hello",
}

# The commands the runbook must give (as argparse parses them).
REQUIRED_COMMANDS = {
    ("stats", "--format", "table"),
    ("session", "SESSION_ID"),
    ("session", "SESSION_ID", "--release-lock", "--yes"),
    ("dlq", "list", "--limit", "20"),
    ("dlq", "show", "DLQ_ID"),
    ("dlq", "redrive", "--id", "DLQ_ID"),
    ("dlq", "redrive", "--rate", "10", "--limit", "100"),
    ("dlq", "purge", "--id", "DLQ_ID"),
}


# ------------------------------------------------------------------------------------------
# helpers


def exported_names() -> set[str]:
    """Every sample name a worker exports: family names plus their _total/_created/_bucket/
    _sum/_count samples, taken from a fresh registry."""
    names: set[str] = set()
    for family in Metrics().registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(f"{family.name}_total")
        if family.type == "histogram":
            names.update(f"{family.name}_{s}" for s in ("bucket", "sum", "count"))
    return names


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not on PATH (apt-get install prometheus provides it)")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def alert_blocks() -> list[str]:
    """The text of each `- alert:` rule in alerts.yml."""
    text = ALERTS_YML.read_text()
    starts = [m.start() for m in re.finditer(r"^\s*- alert:", text, re.M)]
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


def yaml_value(block: str, key: str) -> str | None:
    """A scalar from our own YAML layout: `key: value`, or a `>-`/`|` block scalar whose lines
    are indented deeper than the key (no YAML library in the test dependencies)."""
    lines = block.splitlines()
    for i, line in enumerate(lines):
        m = re.match(rf"^(\s*){re.escape(key)}:\s*(.*?)\s*$", line)
        if not m:
            continue
        indent, rest = len(m.group(1)), m.group(2)
        if rest and rest[0] not in ">|":
            return rest.split(" #", 1)[0].strip().strip("'\"")
        body = []
        for nxt in lines[i + 1 :]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            body.append(nxt.strip())
        return " ".join(x for x in body if x)
    return None


def sum_arguments(expr: str) -> list[str]:
    """The argument of every sum(...) / sum by (...) (...) in a PromQL expression."""
    out = []
    for m in re.finditer(r"\bsum\s*(?:(?:by|without)\s*\([^()]*\)\s*)?\(", expr):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            i += 1
        out.append(expr[m.end() : i - 1])
    return out


def github_anchor(heading: str) -> str:
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def dashboard_panels() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            out.append(p)
            walk(p.get("panels", []))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return out


def runbook_commands() -> list[str]:
    """Every `dialog-worker ...` command of the runbook: lines of code blocks and inline code
    spans that start with the program name."""
    text = RUNBOOK.read_text()
    commands: list[str] = []
    in_block = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            in_block = not in_block
            continue
        if in_block and line.strip().startswith("dialog-worker "):
            commands.append(line.strip())
    commands += re.findall(r"`(dialog-worker(?:\s[^`]*)?)`", text)
    return commands


# ------------------------------------------------------------------------------------------
# (a) promtool check config / rules


def test_promtool_accepts_the_prometheus_config_and_finds_the_rule_file():
    result = run_promtool("check", "config", "config/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    # rule_files is relative to the config file's directory: alerts.yml was found and checked.
    assert "1 rule files found" in result.stdout, result.stdout
    assert "config/alerts.yml" in result.stdout


def test_promtool_accepts_the_alert_rules():
    result = run_promtool("check", "rules", "config/alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(alert_blocks())} rules found" in result.stdout, result.stdout


def test_local_static_configs_example_is_valid_when_uncommented(tmp_path: Path):
    """The commented static_configs block for local use is a working config once
    uncommented (with the dns_sd_configs still in place)."""
    lines = PROMETHEUS_YML.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# static_configs:")
    out, i = lines[:start], start
    while i < len(lines) and lines[i].lstrip().startswith("#"):
        out.append(lines[i].replace("# ", "", 1))
        i += 1
    out += lines[i:]
    config = tmp_path / "prometheus.yml"
    config.write_text("\n".join(out) + "\n")
    shutil.copy(ALERTS_YML, tmp_path / "alerts.yml")
    assert "- targets:" in config.read_text()
    result = run_promtool("check", "config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_config_scrapes_the_worker_job_by_dns_and_loads_the_rules():
    text = PROMETHEUS_YML.read_text()
    assert re.search(rf"^\s*- job_name: {JOB}\s*$", text, re.M)
    assert "dns_sd_configs:" in text
    assert re.search(r"port: 8000\b", text)
    assert re.search(r"^rule_files:\n\s+- alerts\.yml$", text, re.M)


# ------------------------------------------------------------------------------------------
# (b) promtool test rules


def test_alert_unit_tests_pass():
    result = run_promtool("test", "rules", "config/alerts.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_alert_unit_tests_cover_the_required_alerts():
    tests = ALERTS_TEST_YML.read_text()
    for alert in ("DialogOldestPendingAgeHigh", "DialogFencingRejections", "DialogWorkersAllDown"):
        assert re.search(rf"alertname: {alert}\n\s+exp_alerts:\n\s+- exp_labels", tests), alert
        assert re.search(rf"alertname: {alert}\n\s+exp_alerts: \[\]", tests), alert


# ------------------------------------------------------------------------------------------
# (c) Grafana dashboard


def test_dashboard_panels_query_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    known = exported_names() | {"up"}
    used: set[str] = set()
    ids = []
    for panel in dashboard_panels():
        ids.append(panel["id"])
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        for target in panel["targets"]:
            names = metric_names(target["expr"]) | set(re.findall(r"\bup(?=\{)", target["expr"]))
            assert names, f"panel {panel['title']!r}: no metric in {target['expr']!r}"
            assert names <= known, f"panel {panel['title']!r}: unknown {names - known}"
            assert target["datasource"]["uid"] == "${datasource}"
            used |= names
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert CONTRACT_METRICS <= used, f"not on the dashboard: {CONTRACT_METRICS - used}"


def test_dashboard_quantiles_use_the_histogram_buckets():
    exprs = [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]
    for histogram in ("dialog_end_to_end_seconds", "dialog_processing_seconds"):
        for q in ("0.5", "0.99"):
            assert any(
                f"histogram_quantile({q}," in e and f"{histogram}_bucket" in e and "by (le)" in e
                for e in exprs
            ), (histogram, q)


def test_grafana_provisioning_points_at_the_dashboard_folder_and_prometheus():
    dashboards = (PROVISIONING / "dashboards.yml").read_text()
    datasources = (PROVISIONING / "datasources.yml").read_text()
    assert "apiVersion: 1" in dashboards and "apiVersion: 1" in datasources
    assert re.search(r"^\s+path: /var/lib/grafana/dashboards\s*$", dashboards, re.M)
    assert re.search(r"^\s+type: file\s*$", dashboards, re.M)
    assert re.search(r"^\s+type: prometheus\s*$", datasources, re.M)
    assert re.search(r"^\s+url: http://prometheus:9090\s*$", datasources, re.M)


# ------------------------------------------------------------------------------------------
# (d) alert rules


def test_every_alert_uses_exported_metrics_and_is_complete():
    known = exported_names() | {"up"}
    anchors = {
        github_anchor(m.group(1)) for m in re.finditer(r"^## (.+)$", RUNBOOK.read_text(), re.M)
    }
    used: set[str] = set()
    blocks = alert_blocks()
    assert len(blocks) >= 7
    for block in blocks:
        name = yaml_value(block, "- alert")
        expr = yaml_value(block, "expr")
        assert expr, name
        names = metric_names(expr)
        assert names <= known, f"{name}: unknown metric {names - known}"
        used |= names
        assert yaml_value(block, "for") is not None, f"{name}: no for:"
        assert yaml_value(block, "severity") in {"critical", "warning"}, name
        assert yaml_value(block, "summary"), name
        assert yaml_value(block, "description"), name
        runbook = yaml_value(block, "runbook_url")
        assert runbook and runbook.startswith("docs/runbook.md#"), name
        assert runbook.split("#", 1)[1] in anchors, f"{name}: no runbook section {runbook}"
        if "up{" in expr:
            assert f'job="{JOB}"' in expr, name
    assert used >= REQUIRED_ALERT_METRICS, REQUIRED_ALERT_METRICS - used


def test_queue_gauges_are_never_summed_across_replicas():
    """Every replica samples the same queue-level value: sum() would multiply it."""
    gauges = {
        "dialog_group_lag",
        "dialog_pending",
        "dialog_oldest_pending_age_seconds",
        "dialog_delayed",
        "dialog_dlq_length",
        "dialog_stream_length",
    }
    exprs = [yaml_value(b, "expr") or "" for b in alert_blocks()]
    exprs += [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]
    checked = 0
    for expr in exprs:
        for argument in sum_arguments(expr):
            checked += 1
            assert not metric_names(argument) & gauges, expr
    assert checked >= 10
    assert sum_arguments("sum by (job) (max(dialog_pending) + 1)") == ["max(dialog_pending) + 1"]


# ------------------------------------------------------------------------------------------
# (e) runbook commands


def test_runbook_has_every_section():
    anchors = {
        github_anchor(m.group(1)) for m in re.finditer(r"^## (.+)$", RUNBOOK.read_text(), re.M)
    }
    assert anchors >= RUNBOOK_SECTIONS, RUNBOOK_SECTIONS - anchors


def test_every_runbook_command_parses_with_the_real_cli():
    commands = runbook_commands()
    assert len(commands) >= 10
    parser = _parser()
    seen = set()
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "dialog-worker", command
        seen.add(tuple(argv[1:]))
        sample = [RUNBOOK_PLACEHOLDERS.get(a, a) for a in argv[1:]]
        try:
            args = parser.parse_args(sample)
        except SystemExit as exc:  # argparse reports usage errors by exiting
            pytest.fail(f"runbook command does not parse: {command!r} ({exc})")
        if getattr(args, "release_lock", False):
            assert args.yes, f"{command!r}: --release-lock without --yes is refused"
        if args.command == "dlq" and args.dlq_command == "redrive" and args.rate is not None:
            assert args.rate > 0, command
    assert seen >= REQUIRED_COMMANDS, REQUIRED_COMMANDS - seen


# ------------------------------------------------------------------------------------------
# A real Prometheus server scraping a real worker, with the alert rules loaded.


def _get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read().decode())
    except (OSError, ValueError):
        return None


async def _poll(what: str, fn: Any, deadline_s: float) -> Any:
    deadline = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < deadline:
        last = await anyio.to_thread.run_sync(fn)
        if last:
            return last
        await anyio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@contextlib.contextmanager
def prometheus_server(binary: str, config: Path, workdir: Path) -> Iterator[str]:
    """A real Prometheus server on a free local port; yields its base URL."""
    port = free_port()
    with (workdir / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


async def test_real_prometheus_scrapes_a_worker_and_evaluates_every_rule(
    workers, client, tmp_path: Path
):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not on PATH (apt-get install prometheus provides it)")
    [worker] = workers.start(1, metrics=True, DIALOG_METRICS_SAMPLE_INTERVAL_S="0.2")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "  evaluation_interval: 1s\n"
        f"rule_files:\n  - {ALERTS_YML}\n"
        "scrape_configs:\n"
        f"  - job_name: {JOB}\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{worker.metrics_port}']\n"
    )
    with prometheus_server(binary, config, tmp_path) as base:

        def query(promql: str) -> list[dict[str, Any]]:
            url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
            got = _get_json(url)
            return got["data"]["result"] if got and got.get("status") == "success" else []

        def rules_evaluated() -> list[dict[str, Any]] | None:
            got = _get_json(f"{base}/api/v1/rules")
            if not got:
                return None
            rules = [r for g in got["data"]["groups"] for r in g["rules"]]
            if rules and all(not r["lastEvaluation"].startswith("0001") for r in rules):
                return rules
            return None

        await _poll("prometheus ready", lambda: _get_json(f"{base}/api/v1/status/buildinfo"), 20)
        await _poll("worker scraped", lambda: query(f'up{{job="{JOB}"}} == 1'), 20)
        for i in range(20):
            await client.send(f"prom-{i % 4}", "nama saya Budi" if i < 4 else f"halo {i}")
        applied = await _poll(
            "applied messages in prometheus",
            lambda: [
                r
                for r in query(f'dialog_messages_total{{job="{JOB}",outcome="applied"}}')
                if float(r["value"][1]) >= 20
            ],
            20,
        )
        assert applied[0]["metric"]["instance"] == f"127.0.0.1:{worker.metrics_port}"
        outcomes = {r["metric"]["outcome"] for r in query("dialog_messages_total")}
        # Every outcome is exported from the start (at 0 until it happens).
        assert outcomes == {
            "applied", "duplicate", "dead_lettered", "cancelled", "rejected", "superseded",
            "expired", "budget_exceeded", "merged",
        }  # fmt: skip
        assert query("dialog_end_to_end_seconds_bucket")
        assert query(f'dialog_ready{{job="{JOB}"}} == 1')

        rules = await _poll("every rule evaluated", rules_evaluated, 20)
        assert len(rules) == len(alert_blocks())
        for rule in rules:
            assert rule["health"] == "ok", rule
            assert rule["labels"]["severity"] in {"critical", "warning"}
            assert {"summary", "description", "runbook_url"} <= set(rule["annotations"])
        states = {r["name"]: r["state"] for r in rules}
        # A healthy, ready worker: none of the availability alerts is even pending.
        for name in ("DialogWorkersAllDown", "DialogWorkerTargetDown", "DialogRedisUnreachable"):
            assert states[name] == "inactive", states
