"""Settings: contract defaults, precedence, validation errors that name the setting, redaction."""

from __future__ import annotations

import dataclasses
import os
import socket
import textwrap
from pathlib import Path
from typing import Any

import pytest

from dialog_worker.config import (
    Settings,
    decimal_number,
    env_name,
    load_settings,
    redact_url,
    unknown_env_names,
    whole_number,
)
from dialog_worker.errors import ConfigError


@pytest.fixture(autouse=True)
def no_default_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run every test in an empty directory, so a checkout's config/worker.toml is never read."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_config(tmp_path: Path, body: str, name: str = "worker.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


def config_error(
    overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None
) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_settings(overrides, environ={} if environ is None else environ)
    message = str(info.value)
    assert "\n" not in message, "a config error is one line"
    return info.value


# ---------------------------------------------------------------------------------------------
# Defaults


def test_defaults_match_the_contract_table() -> None:
    s = load_settings(environ={})
    assert s.redis_url == "redis://localhost:6379/0"
    assert s.stream == "dialog"
    assert s.group == "dialog-workers"
    assert s.reply_stream == "dialog-replies"
    assert s.dlq_stream == "dialog-dlq"
    assert s.concurrency == 64
    assert s.lock_ttl_ms == 5000
    assert s.visibility_timeout_ms == 30000
    assert s.max_attempts == 5
    assert (s.backoff_base_ms, s.backoff_max_ms) == (500, 30000)
    assert s.state_ttl_s == 86400
    assert s.history_limit == 50
    assert s.dedupe_ttl_s == 86400
    assert s.max_message_bytes == 65536
    assert s.metrics_host == "127.0.0.1"  # loopback unless told (the image sets 0.0.0.0)
    assert s.metrics_port == 8000
    assert s.log_level == "info"
    assert s.log_format == "json"
    assert s.redis_mode == "standalone"
    assert s.shards == 1


def test_default_backoff_bounds_are_ordered_and_grace_is_positive() -> None:
    s = load_settings(environ={})
    assert 1 <= s.backoff_base_ms <= s.backoff_max_ms
    assert s.shutdown_grace_s > 0
    assert s.visibility_timeout_ms >= s.lock_ttl_ms


def test_consumer_defaults_to_hostname_dash_pid_when_unset() -> None:
    assert load_settings(environ={}).consumer.startswith(f"{socket.gethostname()}-{os.getpid()}-")
    assert load_settings(environ={}).consumer == load_settings(environ={}).consumer


def test_consumer_defaults_to_hostname_dash_pid_when_env_is_empty() -> None:
    s = load_settings(environ={"DIALOG_CONSUMER": ""})
    assert s.consumer.startswith(f"{socket.gethostname()}-{os.getpid()}-")


def test_consumer_from_env_and_flag_is_kept() -> None:
    assert load_settings(environ={"DIALOG_CONSUMER": "w-env"}).consumer == "w-env"
    s = load_settings({"consumer": "w-flag"}, environ={"DIALOG_CONSUMER": "w-env"})
    assert s.consumer == "w-flag"


def test_key_prefix_defaults_to_the_stream_name() -> None:
    assert load_settings(environ={"DIALOG_STREAM": "inbox"}).prefix == "inbox"
    s = load_settings(environ={"DIALOG_STREAM": "inbox", "DIALOG_KEY_PREFIX": "kp"})
    assert s.prefix == "kp"


def test_settings_are_frozen() -> None:
    s = load_settings(environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.concurrency = 1  # type: ignore[misc]


def test_group_reply_and_dlq_names_derive_from_the_stream_unless_set() -> None:
    s = load_settings(environ={"DIALOG_STREAM": "echo"})
    assert (s.group, s.reply_stream, s.dlq_stream, s.prefix) == (
        "echo-workers",
        "echo-replies",
        "echo-dlq",
        "echo",
    )
    s = load_settings(environ={"DIALOG_STREAM": "echo", "DIALOG_DLQ_STREAM": "shared-dlq"})
    assert (s.group, s.reply_stream, s.dlq_stream) == ("echo-workers", "echo-replies", "shared-dlq")


def test_replacing_the_stream_moves_derived_names_and_keeps_explicit_ones() -> None:
    s = load_settings(environ={"DIALOG_GROUP": "mine"}).replace(stream="other")
    assert (s.group, s.reply_stream, s.dlq_stream) == ("mine", "other-replies", "other-dlq")


# ---------------------------------------------------------------------------------------------
# Environment names


@pytest.mark.parametrize(
    ("field", "env"),
    [
        ("redis_url", "REDIS_URL"),
        ("stream", "DIALOG_STREAM"),
        ("group", "DIALOG_GROUP"),
        ("reply_stream", "DIALOG_REPLY_STREAM"),
        ("dlq_stream", "DIALOG_DLQ_STREAM"),
        ("consumer", "DIALOG_CONSUMER"),
        ("concurrency", "DIALOG_CONCURRENCY"),
        ("lock_ttl_ms", "DIALOG_LOCK_TTL_MS"),
        ("visibility_timeout_ms", "DIALOG_VISIBILITY_TIMEOUT_MS"),
        ("max_attempts", "DIALOG_MAX_ATTEMPTS"),
        ("backoff_base_ms", "DIALOG_BACKOFF_BASE_MS"),
        ("backoff_max_ms", "DIALOG_BACKOFF_MAX_MS"),
        ("state_ttl_s", "DIALOG_STATE_TTL_S"),
        ("history_limit", "DIALOG_HISTORY_LIMIT"),
        ("dedupe_ttl_s", "DIALOG_DEDUPE_TTL_S"),
        ("max_message_bytes", "DIALOG_MAX_MESSAGE_BYTES"),
        ("engine", "DIALOG_ENGINE"),
        ("metrics_host", "DIALOG_METRICS_HOST"),
        ("metrics_port", "DIALOG_METRICS_PORT"),
        ("log_level", "DIALOG_LOG_LEVEL"),
        ("log_format", "DIALOG_LOG_FORMAT"),
        ("shutdown_grace_s", "DIALOG_SHUTDOWN_GRACE_S"),
        ("redis_mode", "DIALOG_REDIS_MODE"),
        ("shards", "DIALOG_SHARDS"),
    ],
)
def test_env_names_follow_the_contract(field: str, env: str) -> None:
    assert env_name(field) == env


@pytest.mark.parametrize(
    ("env", "raw", "field", "expected"),
    [
        ("REDIS_URL", "rediss://h:6380/2", "redis_url", "rediss://h:6380/2"),
        ("DIALOG_STREAM", "in", "stream", "in"),
        ("DIALOG_GROUP", "g", "group", "g"),
        ("DIALOG_REPLY_STREAM", "out", "reply_stream", "out"),
        ("DIALOG_DLQ_STREAM", "dead", "dlq_stream", "dead"),
        ("DIALOG_CONCURRENCY", " 8 ", "concurrency", 8),
        ("DIALOG_LOCK_TTL_MS", "1000", "lock_ttl_ms", 1000),
        ("DIALOG_MAX_ATTEMPTS", "7", "max_attempts", 7),
        ("DIALOG_STATE_TTL_S", "60", "state_ttl_s", 60),
        ("DIALOG_HISTORY_LIMIT", "0", "history_limit", 0),
        ("DIALOG_DEDUPE_TTL_S", "120", "dedupe_ttl_s", 120),
        ("DIALOG_MAX_MESSAGE_BYTES", "16", "max_message_bytes", 16),
        ("DIALOG_METRICS_HOST", "127.0.0.1", "metrics_host", "127.0.0.1"),
        ("DIALOG_METRICS_PORT", "0", "metrics_port", 0),
        ("DIALOG_LOG_LEVEL", "DEBUG", "log_level", "debug"),
        ("DIALOG_LOG_FORMAT", "console", "log_format", "console"),
        ("DIALOG_SHUTDOWN_GRACE_S", "2.5", "shutdown_grace_s", 2.5),
        ("DIALOG_ENGINE", "pkg.mod:factory", "engine", "pkg.mod:factory"),
    ],
)
def test_each_env_var_sets_its_field(env: str, raw: str, field: str, expected: Any) -> None:
    assert getattr(load_settings(environ={env: raw}), field) == expected


@pytest.mark.parametrize("url", ["redis://h:1/0", "rediss://u:p@h:6380/0", "unix:///tmp/r.sock"])
def test_every_contract_url_scheme_is_accepted(url: str) -> None:
    assert load_settings(environ={"REDIS_URL": url}).redis_url == url


def test_redis_url_embedded_is_the_socket_in_the_users_own_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", "/home/budi")
    url = load_settings(environ={"REDIS_URL": "embedded"}).redis_url
    assert url == "unix:///home/budi/.local/share/dialog-worker/embedded/redis.sock"
    monkeypatch.setenv("HOME", "/h" + "o" * 70)  # a socket path of more than 107 bytes
    exc = config_error(environ={"REDIS_URL": "embedded"})
    assert exc.setting == "REDIS_URL" and "107 bytes" in str(exc)


# ---------------------------------------------------------------------------------------------
# Precedence: flag > env > file > default


FLAT = """\
    concurrency = 10
    stream = "file-stream"
    lock_ttl_ms = 4000
"""

TABLE = """\
    [worker]
    concurrency = 10
    stream = "file-stream"
    lock_ttl_ms = 4000
"""


@pytest.mark.parametrize("body", [FLAT, TABLE], ids=["flat-keys", "worker-table"])
def test_precedence_is_flag_over_env_over_file_over_default(tmp_path: Path, body: str) -> None:
    path = write_config(tmp_path, body)
    base = {"DIALOG_CONFIG": str(path)}
    env = {**base, "DIALOG_CONCURRENCY": "20", "DIALOG_STREAM": "env-stream"}

    s = load_settings({"concurrency": 30}, environ=env)
    assert s.concurrency == 30  # flag
    assert s.stream == "env-stream"  # env
    assert s.lock_ttl_ms == 4000  # file
    assert s.max_attempts == 5  # default

    s = load_settings(environ=env)
    assert (s.concurrency, s.stream) == (20, "env-stream")

    s = load_settings(environ=base)
    assert (s.concurrency, s.stream, s.lock_ttl_ms) == (10, "file-stream", 4000)


def test_flag_given_as_none_means_not_given() -> None:
    s = load_settings({"concurrency": None}, environ={"DIALOG_CONCURRENCY": "20"})
    assert s.concurrency == 20


def test_default_config_file_in_working_directory_is_read(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    write_config(tmp_path, "concurrency = 11\n", name="config/worker.toml")
    assert load_settings(environ={}).concurrency == 11


def test_dialog_config_replaces_the_default_config_file(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    write_config(tmp_path, "concurrency = 11\n", name="config/worker.toml")
    other = write_config(tmp_path, "concurrency = 12\n", name="other.toml")
    assert load_settings(environ={"DIALOG_CONFIG": str(other)}).concurrency == 12


def test_file_values_of_toml_types_are_validated_like_env_values(tmp_path: Path) -> None:
    path = write_config(tmp_path, 'concurrency = 9\nlog_level = "WARNING"\nshutdown_grace_s = 3\n')
    s = load_settings(environ={"DIALOG_CONFIG": str(path)})
    assert (s.concurrency, s.log_level, s.shutdown_grace_s) == (9, "warning", 3.0)


# ---------------------------------------------------------------------------------------------
# Invalid values: ConfigError naming the env var / flag


@pytest.mark.parametrize(
    ("env", "raw"),
    [
        ("DIALOG_CONCURRENCY", "abc"),
        ("DIALOG_CONCURRENCY", "1.5"),
        ("DIALOG_CONCURRENCY", ""),
        ("DIALOG_CONCURRENCY", "0"),
        ("DIALOG_CONCURRENCY", "-3"),
        ("DIALOG_LOCK_TTL_MS", "99"),
        ("DIALOG_VISIBILITY_TIMEOUT_MS", "ten"),
        ("DIALOG_MAX_ATTEMPTS", "0"),
        ("DIALOG_BACKOFF_BASE_MS", "0"),
        ("DIALOG_BACKOFF_MAX_MS", "x"),
        ("DIALOG_STATE_TTL_S", "0"),
        ("DIALOG_HISTORY_LIMIT", "-1"),
        ("DIALOG_DEDUPE_TTL_S", "0"),
        ("DIALOG_MAX_MESSAGE_BYTES", "0"),
        ("DIALOG_METRICS_PORT", "65536"),
        ("DIALOG_METRICS_PORT", "-1"),
        ("DIALOG_METRICS_PORT", "http"),
        ("DIALOG_SHARDS", "0"),
        ("DIALOG_SHUTDOWN_GRACE_S", "-1"),
        ("DIALOG_SHUTDOWN_GRACE_S", "soon"),
        ("DIALOG_LOG_LEVEL", "verbose"),
        ("DIALOG_LOG_FORMAT", "xml"),
        ("DIALOG_REDIS_MODE", "sentinel"),
        ("DIALOG_STREAM", ""),
        ("DIALOG_STREAM", "has space"),
        ("DIALOG_GROUP", "  "),
        ("DIALOG_METRICS_HOST", ""),
        ("REDIS_URL", "http://localhost:6379"),
        ("REDIS_URL", "localhost:6379"),
    ],
)
def test_invalid_env_value_raises_config_error_naming_the_env_var(env: str, raw: str) -> None:
    exc = config_error(environ={env: raw})
    assert exc.setting == env
    assert str(exc).startswith(f"{env}:")


@pytest.mark.parametrize(
    ("field", "raw", "flag"),
    [
        ("concurrency", "many", "--concurrency"),
        ("concurrency", 0, "--concurrency"),
        ("concurrency", True, "--concurrency"),
        ("log_level", "loud", "--log-level"),
        ("redis_url", "http://h", "--redis-url"),
        ("metrics_port", 70000, "--metrics-port"),
    ],
)
def test_invalid_flag_value_raises_config_error_naming_the_flag(
    field: str, raw: Any, flag: str
) -> None:
    exc = config_error({field: raw}, environ={"DIALOG_CONCURRENCY": "5"})
    assert exc.setting == flag
    assert flag in str(exc)


def test_unknown_flag_raises_config_error_naming_it() -> None:
    exc = config_error({"no_such_setting": 1})
    assert "no_such_setting" in str(exc)


@pytest.mark.parametrize(
    "body",
    [
        "concurrency = true\n",
        'concurrency = "lots"\n',
        "concurrency = 2.5\n",
        "[worker]\nshards = 0\n",
    ],
)
def test_invalid_file_value_raises_config_error_naming_the_key(tmp_path: Path, body: str) -> None:
    path = write_config(tmp_path, body)
    exc = config_error(environ={"DIALOG_CONFIG": str(path)})
    key = body.split("=")[0].split()[-1]
    assert key in str(exc)
    assert "config file" in str(exc)


@pytest.mark.parametrize("body", [FLAT + "concurency = 3\n", TABLE + "concurency = 3\n"])
def test_unknown_key_in_file_raises_config_error(tmp_path: Path, body: str) -> None:
    path = write_config(tmp_path, body)
    exc = config_error(environ={"DIALOG_CONFIG": str(path)})
    assert exc.setting == "DIALOG_CONFIG"
    assert "concurency" in str(exc)


def test_missing_dialog_config_file_raises_config_error(tmp_path: Path) -> None:
    exc = config_error(environ={"DIALOG_CONFIG": str(tmp_path / "nope.toml")})
    assert exc.setting == "DIALOG_CONFIG"
    assert "nope.toml" in str(exc)


def test_unparseable_config_file_raises_config_error(tmp_path: Path) -> None:
    path = write_config(tmp_path, "concurrency = = 3\n")
    exc = config_error(environ={"DIALOG_CONFIG": str(path)})
    assert exc.setting == "DIALOG_CONFIG"


def test_worker_entry_that_is_not_a_table_raises_config_error(tmp_path: Path) -> None:
    path = write_config(tmp_path, 'worker = "yes"\n')
    assert config_error(environ={"DIALOG_CONFIG": str(path)}).setting == "DIALOG_CONFIG"


def test_backoff_max_below_base_raises_config_error() -> None:
    exc = config_error(environ={"DIALOG_BACKOFF_BASE_MS": "200", "DIALOG_BACKOFF_MAX_MS": "100"})
    assert exc.setting == "DIALOG_BACKOFF_MAX_MS"
    assert "DIALOG_BACKOFF_BASE_MS" in str(exc)


def test_backoff_max_equal_to_base_is_allowed() -> None:
    s = load_settings(environ={"DIALOG_BACKOFF_BASE_MS": "100", "DIALOG_BACKOFF_MAX_MS": "100"})
    assert s.backoff_max_ms == s.backoff_base_ms == 100


def test_visibility_timeout_below_lock_ttl_raises_config_error() -> None:
    exc = config_error(
        environ={"DIALOG_LOCK_TTL_MS": "6000", "DIALOG_VISIBILITY_TIMEOUT_MS": "5999"}
    )
    assert exc.setting == "DIALOG_VISIBILITY_TIMEOUT_MS"
    assert "DIALOG_LOCK_TTL_MS" in str(exc)


def test_visibility_timeout_equal_to_lock_ttl_is_allowed() -> None:
    s = load_settings(
        environ={"DIALOG_LOCK_TTL_MS": "6000", "DIALOG_VISIBILITY_TIMEOUT_MS": "6000"}
    )
    assert s.visibility_timeout_ms == 6000


def test_relation_check_applies_to_flags_too() -> None:
    exc = config_error({"lock_ttl_ms": 40_000})
    assert exc.setting == "DIALOG_VISIBILITY_TIMEOUT_MS"


def test_nan_shutdown_grace_raises_config_error() -> None:
    assert config_error(environ={"DIALOG_SHUTDOWN_GRACE_S": "nan"}).setting == (
        "DIALOG_SHUTDOWN_GRACE_S"
    )


# ---------------------------------------------------------------------------------------------
# Passwords never appear in errors; redact_url


@pytest.mark.parametrize(
    "url", ["http://user:s3cret@h:6379/0", "tcp://:s3cret@h", "mysql://u:s3cret@h"]
)
def test_bad_url_scheme_error_does_not_echo_the_password(url: str) -> None:
    exc = config_error(environ={"REDIS_URL": url})
    assert exc.setting == "REDIS_URL"
    assert "s3cret" not in str(exc)

    exc = config_error({"redis_url": url})
    assert exc.setting == "--redis-url"
    assert "s3cret" not in str(exc)


@pytest.mark.parametrize(
    "url",
    [
        "redis://localhost:notaport/0",
        "redis://localhost:99999/0",
        "redis://h:s3cret/0",  # a password where the port belongs
        "redis://h:6379/0?socket_timeout=soon",
    ],
)
def test_malformed_url_is_a_config_error_that_does_not_echo_the_value(url: str) -> None:
    exc = config_error(environ={"REDIS_URL": url})
    assert exc.setting == "REDIS_URL"
    assert "s3cret" not in str(exc) and "notaport" not in str(exc)


@pytest.mark.parametrize("url", ["user:s3cret@localhost:6379/0", "redis:/user:s3cret@h:6379/0"])
def test_schemeless_url_error_does_not_echo_the_password(url: str) -> None:
    assert "s3cret" not in str(config_error(environ={"REDIS_URL": url}))


@pytest.mark.parametrize(
    ("url", "password", "expected"),
    [
        ("redis://user:pw@h:1/0", "pw", "redis://user:***@h:1/0"),
        ("redis://:pw@h", "pw", "redis://:***@h"),
        ("rediss://default:p@ss:w@h:6380/1", "p@ss:w", "rediss://default:***@h:6380/1"),
    ],
)
def test_redact_url_hides_the_password(url: str, password: str, expected: str) -> None:
    redacted = redact_url(url)
    assert redacted == expected
    assert password not in redacted


@pytest.mark.parametrize(
    "url",
    ["redis://localhost:6379/0", "rediss://h:6380/1", "unix:///tmp/redis.sock", "redis://user@h/0"],
)
def test_redact_url_leaves_urls_without_password_unchanged(url: str) -> None:
    assert redact_url(url) == url


def test_settings_redacted_url_hides_the_password() -> None:
    s = load_settings(environ={"REDIS_URL": "redis://u:s3cret@h:1/0"})
    assert s.redis_url == "redis://u:s3cret@h:1/0"
    assert "s3cret" not in s.redacted_url()


@pytest.mark.parametrize(
    "url", ["redis://h:6379/0?password=s3cret", "unix:///tmp/r.sock?db=0&password=s3cret"]
)
def test_redact_url_hides_a_password_given_in_the_query_string(url: str) -> None:
    assert "s3cret" not in redact_url(url)


def test_settings_class_defaults_equal_loaded_defaults() -> None:
    loaded = load_settings(environ={})
    assert dataclasses.replace(loaded, consumer="") == Settings()


def test_a_misspelled_dialog_variable_warns_once_naming_the_closest_setting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = {"DIALOG_CONCURENCY": "8", "DIALOG_CONFIG_FILE": "x", "DIALOG_ZZZZZZZZZZZZ": "1"}
    for _ in range(2):
        load_settings(environ={**env, "DIALOG_CONFIG": "/dev/null"})
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "dialog-worker: warning: DIALOG_CONCURENCY is not a setting and is ignored; "
        "did you mean DIALOG_CONCURRENCY?",
        "dialog-worker: warning: DIALOG_CONFIG_FILE is not a setting and is ignored; "
        "did you mean DIALOG_CONFIG?",
        "dialog-worker: warning: DIALOG_ZZZZZZZZZZZZ is not a setting and is ignored; "
        "see docs/configuration.md",
    ]
    assert unknown_env_names({"DIALOG_CONCURRENCY": "8", "REDIS_URL": "redis://x"}) == []


def test_worker_processes_under_a_supervisor_do_not_repeat_its_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = {"DIALOG_CONFIG": "/dev/null", "DIALOG_SUPERVISOR_PID": "1", "DIALOG_LOG_LEVL": "x"}
    load_settings(environ=env)
    assert capsys.readouterr().err == ""


def test_echo_fields_are_checked_at_start() -> None:
    ok = load_settings(environ={"DIALOG_ECHO_FIELDS": " channel , chat_id "})
    assert ok.echo_fields == "channel,chat_id"
    assert load_settings(environ={}).echo_fields == ""
    for value, why in [
        ("channel,session_id", "'session_id' is a field the worker uses itself"),
        ("text", "'text' is a field the worker uses itself"),
        ("bubbles", "'bubbles' is a field the worker uses itself"),
        ("channel,channel", "a field is listed twice"),
        ("chat id", "is not a field name"),
        (",".join(f"f{i}" for i in range(17)), "at most 16 fields"),
    ]:
        with pytest.raises(ConfigError, match=why) as raised:
            load_settings(environ={"DIALOG_ECHO_FIELDS": value})
        assert raised.value.setting == "DIALOG_ECHO_FIELDS"


def test_message_ttl_is_a_number_of_seconds_zero_off() -> None:
    assert load_settings(environ={}).message_ttl_s == 0
    assert load_settings(environ={"DIALOG_MESSAGE_TTL_S": "7200"}).message_ttl_s == 7200
    with pytest.raises(ConfigError, match="DIALOG_MESSAGE_TTL_S"):
        load_settings(environ={"DIALOG_MESSAGE_TTL_S": "-1"})


def test_a_cluster_url_may_name_several_startup_nodes() -> None:
    from dialog_worker.config import cluster_startup_nodes

    url = "redis://user:pw@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002/0?socket_timeout=3"
    s = load_settings(environ={"REDIS_URL": url, "DIALOG_REDIS_MODE": "cluster"})
    first, nodes = cluster_startup_nodes(s.redis_url)
    assert first == "redis://user:pw@10.0.0.1:7000/0?socket_timeout=3"
    assert nodes == [("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002)]
    assert "pw" not in s.redacted_url() and "10.0.0.2:7001" in s.redacted_url()
    assert cluster_startup_nodes("redis://h:1/0") == ("redis://h:1/0", [("h", 1)])


@pytest.mark.parametrize(
    ("url", "mode", "says"),
    [
        ("redis://a:1,b:x/0", "cluster", "port"),
        ("redis://a:1,,b:2/0", "cluster", "host"),
        ("redis://a:1,b:2/0", "standalone", "DIALOG_REDIS_MODE=cluster"),
    ],
)
def test_a_bad_list_of_startup_nodes_is_one_clear_line(url: str, mode: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(environ={"REDIS_URL": url, "DIALOG_REDIS_MODE": mode})
    assert says in str(caught.value) and "REDIS_URL" in str(caught.value)


def test_sentinels_listed_with_commas_are_not_cluster_startup_nodes() -> None:
    url = "redis+sentinel://10.0.0.5:26379,10.0.0.6:26379/mymaster/0"
    assert load_settings(environ={"REDIS_URL": url}).redis_url == url


@pytest.mark.parametrize(
    "raw",
    [
        "1_000",
        "\u0661\u0660\u0660",
        "\uff11\uff10",
        "1e3",
        "1.0",
        "0x10",
        "",
        " ",
        "+",
        "--1",
        True,
        2.0,
        None,
    ],
)
def test_a_whole_number_setting_takes_plain_ascii_digits_only(raw: Any) -> None:
    """Python's int() takes "1_000" and other scripts' digits; a setting does not (nor do
    `limits set` and `tenants set`, which use the same check)."""
    with pytest.raises(ValueError, match="expected a whole number"):
        whole_number(raw, 0)
    exc = config_error(environ={"DIALOG_TENANT_DAILY_TOKENS": str(raw)})
    assert exc.setting == "DIALOG_TENANT_DAILY_TOKENS"


@pytest.mark.parametrize(("raw", "value"), [("0", 0), (" 42 ", 42), ("+7", 7), (12, 12)])
def test_a_whole_number_setting_takes_digits_and_ints(raw: Any, value: int) -> None:
    assert whole_number(raw, 0, 10**12) == value


def test_a_whole_number_past_its_bound_is_refused_exactly_not_rounded() -> None:
    with pytest.raises(ValueError, match=r"got 100000000000000000000000000$"):
        whole_number("100000000000000000000000000", 0, 10**12)
    exc = config_error(environ={"DIALOG_TENANT_DAILY_TOKENS": "10000000000001"})
    assert "between 0 and 1000000000000" in str(exc)


@pytest.mark.parametrize("raw", ["1_0", "\u0662", "inf", "nan", "1e999", "", "0x1p3", True])
def test_a_number_setting_takes_plain_ascii_decimals_only(raw: Any) -> None:
    with pytest.raises(ValueError):
        decimal_number(raw, 0.0)


@pytest.mark.parametrize(("raw", "value"), [("2.5", 2.5), (".5", 0.5), ("1e3", 1000.0), (3, 3.0)])
def test_a_number_setting_takes_decimals(raw: Any, value: float) -> None:
    assert decimal_number(raw, 0.0) == value
