"""The deployment files, checked as far as a machine without a Docker engine allows.

- Image: the Dockerfile's builder stage is replayed (its COPY sources, filtered through
  .dockerignore, into an empty folder; its RUN line builds the wheelhouse), then the runtime
  stage's install step runs scripts/install-wheel.sh offline into a fresh venv. A burst goes
  through `dialog-worker run` from that venv, and the Dockerfile's HEALTHCHECK command is run
  against it.
- docker-compose.yml and deploy/kubernetes/*.yaml are parsed and checked against the settings
  (every DIALOG_* name must be a real setting), the shutdown grace, the probes' paths and the
  stream and group names. Schemas: the Compose Specification (the copy check-jsonschema ships)
  and the Kubernetes OpenAPI schemas (kubernetes-validate), both offline, when installed. KEDA's
  CRDs have no offline schema: they are checked structurally.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import importlib.resources
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from redis_server import free_port, wait_until

from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings, env_name, load_settings
from dialog_worker.store.keys import Keys

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DEFAULTS = Settings()
SETTING_ENV_NAMES = {env_name(f.name) for f in dataclasses.fields(Settings)} | {"DIALOG_CONFIG"}


def check_env_names(env: dict[str, Any], where: str) -> None:
    """Every DIALOG_* variable names a setting, and the values pass the worker's validation."""
    unknown = sorted(n for n in env if n.startswith("DIALOG_") and n not in SETTING_ENV_NAMES)
    assert unknown == [], f"{where}: not settings of dialog_worker.config: {unknown}"
    load_settings(environ={k: str(v) for k, v in env.items()})


def seconds(value: str | int | float) -> float:
    """A compose duration ("35s", "1m30s") or a number of seconds."""
    if isinstance(value, int | float):
        return float(value)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"bad duration {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


# ---------------------------------------------------------------------------------------------
# Dockerfile


@dataclasses.dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]]

    def all(self, instruction: str) -> list[str]:
        return [args for name, args in self.instructions if name == instruction]

    def last(self, instruction: str) -> str:
        found = self.all(instruction)
        assert found, f"stage {self.name} has no {instruction}"
        return found[-1]


def dockerfile_stages() -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with continuation lines joined."""
    logical: list[str] = []
    current = ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or (not current and not line.strip()):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append((current + line).strip())
        current = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), flags=re.I)
            assert m, line
            stages.append(Stage(m.group(2) or str(len(stages)), m.group(1), []))
        elif not stages:
            assert instruction == "ARG", f"only ARG may precede the first FROM: {line}"
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        else:
            stages[-1].instructions.append((instruction, rest.strip()))
    return args, stages


def docker_env(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in stage.all("ENV"):
        for token in shlex.split(args):
            name, _, value = token.partition("=")
            env[name] = value
    return env


def test_dockerfile_is_multi_stage_non_root_with_healthcheck_and_clean_stop() -> None:
    args, stages = dockerfile_stages()
    assert len(stages) >= 2
    builder, runtime = stages[0], stages[-1]
    assert builder.name == "builder"
    for stage in (builder, runtime):
        base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], stage.base)
        assert base == "python:3.11-slim"
    user = runtime.last("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER must be a numeric non-root uid, got {user}"
    assert runtime.last("STOPSIGNAL") == "SIGTERM"
    assert json.loads(runtime.last("ENTRYPOINT")) == ["dialog-worker"]
    assert json.loads(runtime.last("CMD")) == ["run"]
    assert runtime.last("EXPOSE") == "8000"
    assert "/healthz" in runtime.last("HEALTHCHECK")
    env = docker_env(runtime)
    assert env["DIALOG_METRICS_HOST"] == "0.0.0.0" and env["DIALOG_METRICS_PORT"] == "8000"
    check_env_names(env, "Dockerfile ENV")
    # The runtime installs with the script the test below runs, from the builder's wheels.
    assert "scripts/install-wheel.sh /usr/local/bin/install-wheel.sh" in runtime.all("COPY")
    [install] = [r for r in runtime.all("RUN") if "install-wheel.sh" in r]
    assert "from=builder" in install and "PIP_NO_INDEX=1" in install
    assert "EXTRAS=http" in install


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.removeprefix("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + pattern[i : end + 1], end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((negate, re.compile(regex)))
    return rules


def docker_ignored(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent folder
    excludes everything under it."""
    parts = rel.split("/")
    ignored = False
    for negate, regex in rules:
        if any(regex.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def _entries(folder: Path) -> list[Path]:
    """Files and links under ``folder``, not looking inside linked folders."""
    found = []
    for root, dirs, names in os.walk(folder):
        base = Path(root)
        found += [base / d for d in dirs if (base / d).is_symlink()]
        found += [base / n for n in names]
    return found


def copy_context(sources: list[str], dest: Path, rules: list[tuple[bool, re.Pattern[str]]]) -> int:
    copied = 0
    for source in sources:
        path = REPO / source
        assert path.exists(), f"COPY source {source} does not exist"
        assert not docker_ignored(source, rules), f"COPY source {source} is in .dockerignore"
        # A link is copied as a link (as COPY does): worker/dialog_worker/lua points at lua/.
        files = [path] if path.is_file() else _entries(path)
        for f in files:
            rel = f.relative_to(REPO).as_posix()
            if docker_ignored(rel, rules):
                continue
            target = dest / f.relative_to(path.parent) if path.is_dir() else dest / f.name
            target.parent.mkdir(parents=True, exist_ok=True)
            if f.is_symlink():
                target.symlink_to(os.readlink(f))
            else:
                shutil.copy2(f, target)
            copied += 1
    return copied


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Replay the image build: returns the venv the runtime stage would hold."""
    tmp = tmp_path_factory.mktemp("image")
    _, stages = dockerfile_stages()
    builder, runtime = stages[0], stages[-1]
    rules = dockerignore_rules()
    assert builder.last("WORKDIR") == "/src"
    src = tmp / "src"
    for copy_args in builder.all("COPY"):
        *sources, dest = shlex.split(copy_args)
        target = src / dest.removeprefix("./")
        if dest.endswith("/") or len(sources) > 1:
            copy_context(sources, target, rules)
        else:  # COPY dir ./dir or COPY file ./path/file
            copy_context(sources, target.parent, rules)
    assert (src / "worker" / "dialog_worker" / "__init__.py").is_file()
    [build] = builder.all("RUN")
    # The project with the http extra: the gateway and the console run from the same image.
    assert shlex.split(build) == [*"python -m pip wheel --wheel-dir /wheels".split(), ".[http]"]
    wheels = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(wheels), ".[http]"],
        cwd=src,
        check=True,
        timeout=300,
    )
    # Runtime stage: `PIP_NO_INDEX=1 /bin/sh <install-wheel.sh> /opt/dialog-worker /wheels`.
    [install] = [r for r in runtime.all("RUN") if "install-wheel.sh" in r]
    command = shlex.split(install.split("&&")[0])
    while command[0].startswith("--mount"):
        command.pop(0)
    assignments = dict(c.split("=", 1) for c in command if re.fullmatch(r"[A-Z_]+=.*", c))
    shell, _script, venv_dir, wheelhouse = command[len(assignments) :]
    assert (shell, wheelhouse) == ("/bin/sh", "/wheels")
    assert "/opt/dialog-worker/bin" in docker_env(runtime)["PATH"].split(":")
    venv = tmp / venv_dir.lstrip("/")
    subprocess.run(
        [shell, str(REPO / "scripts" / "install-wheel.sh"), str(venv), str(wheels)],
        env={**os.environ, **assignments, "PYTHON": sys.executable},
        check=True,
        timeout=300,
    )
    return venv


def test_installed_package_carries_every_lua_script_and_the_default_rules(image: Path) -> None:
    [site] = image.glob("lib/python3*/site-packages")
    installed = {p.name: p.read_bytes() for p in (site / "dialog_worker" / "lua").glob("*.lua")}
    repo = {p.name: p.read_bytes() for p in (REPO / "lua").glob("*.lua")}
    assert installed == repo and repo
    default_rules = (site / "dialog_worker" / "defaults" / "rules.toml").read_bytes()
    assert default_rules == (REPO / "config" / "rules.toml").read_bytes()


def healthcheck_command(python: Path) -> list[str]:
    """The Dockerfile's HEALTHCHECK, with the image's `python` replaced by the venv's."""
    _, stages = dockerfile_stages()
    exec_form = stages[-1].last("HEALTHCHECK").split(" CMD ", 1)[1]
    command = json.loads(exec_form)
    assert command[0] == "python"
    return [str(python), *command[1:]]


def test_burst_through_dialog_worker_run_from_the_installed_venv(
    image: Path, env: dict[str, str], tmp_path: Path
) -> None:
    """20 messages over 5 sessions, sent with the venv's DialogClient and console script,
    applied by `dialog-worker run` from the venv (no PYTHONPATH: only the installed copy)."""
    bin_dir = image / "bin"
    app = tmp_path / "app"  # like WORKDIR /app: empty, no lua/ or config/ next to it
    app.mkdir()
    port = free_port()
    venv_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    venv_env.update(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        DIALOG_METRICS_HOST="127.0.0.1",
        DIALOG_METRICS_PORT=str(port),
        DIALOG_CONSUMER="image-1",
    )
    health = healthcheck_command(bin_dir / "python")

    def healthy() -> bool:
        done = subprocess.run(health, env=venv_env, cwd=app, capture_output=True, timeout=10)
        return done.returncode == 0

    assert not healthy()  # nothing listens yet: the check must be able to fail
    log = (tmp_path / "dialog_worker.log").open("wb")
    proc = subprocess.Popen(
        [str(bin_dir / "dialog-worker"), "run"],
        env=venv_env,
        cwd=app,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    try:
        wait_until(healthy, 30, interval_s=0.1, what="the Dockerfile HEALTHCHECK to pass")

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    return r.status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_until(ready, 30, what="/readyz 200")
        sessions = [f"image-{i}" for i in range(5)]
        texts = ["nama saya Budi", "pesan 2", "pesan 3", "saya ada kendala billing"]
        first = subprocess.run(
            [str(bin_dir / "dialog-worker"), "send", sessions[0], texts[0]],
            env=venv_env,
            cwd=app,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout)["session_id"] == sessions[0]
        sender = (
            "import asyncio, json, sys\n"
            "from dialog_worker.client.dialog_client import DialogClient\n"
            "async def main():\n"
            "    async with DialogClient() as c:\n"
            "        for sid, text in json.loads(sys.argv[1]):\n"
            "            await c.send(sid, text)\n"
            "asyncio.run(main())\n"
        )
        rest = [(s, t) for s in sessions for t in texts][1:]
        sent = subprocess.run(
            [str(bin_dir / "python"), "-c", sender, json.dumps(rest)],
            env=venv_env,
            cwd=app,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sent.returncode == 0, sent.stderr
        settings = load_settings(environ=venv_env)
        keys = Keys.from_settings(settings)
        r = redis.Redis.from_url(venv_env["REDIS_URL"], decode_responses=True)
        wait_until(
            lambda: all(
                int(r.hget(keys.session(s).state, "a") or 0) == len(texts) for s in sessions
            ),
            30,
            what="all 20 messages applied",
        )
        r.close()

        async def states() -> list[dict[str, Any] | None]:
            async with DialogClient(settings=settings) as c:
                return [await c.state(s) for s in sessions]

        for state in asyncio.run(states()):
            assert state is not None and state["applied_seq"] == len(texts)
            assert [t["user"] for t in state["history"]] == texts
            assert state["step"] == "COMPLETED" and state["memory"]["userName"] == "Budi"
        shown = subprocess.run(
            [str(bin_dir / "dialog-worker"), "state", sessions[-1]],
            env=venv_env,
            cwd=app,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert json.loads(shown.stdout)["applied_seq"] == len(texts)
        proc.send_signal(signal.SIGTERM)  # what `docker stop` sends (STOPSIGNAL SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not healthy()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_and_console_run_from_the_installed_venv(
    image: Path, env: dict[str, str], tmp_path: Path
) -> None:
    """The image's venv has the http extra: `dialog-worker serve` and `console` start from it
    (no PYTHONPATH: only the installed copy), answer their health checks, and refuse what
    carries no token."""
    bin_dir = image / "bin"
    app = tmp_path / "app"
    app.mkdir()
    venv_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    gateway_port, console_port = free_port(), free_port()
    venv_env.update(
        DIALOG_HTTP_PORT=str(gateway_port),
        DIALOG_HTTP_TOKEN="server-token-0123456789",
        DIALOG_HTTP_SIGNING_KEY="s" * 40,
        DIALOG_CONSOLE_PORT=str(console_port),
        DIALOG_CONSOLE_OPERATORS="ops:console-token-0123456789",
    )

    def status(url: str) -> int:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    procs = []
    for command in ("serve", "console"):
        log = (tmp_path / f"{command}.log").open("wb")
        procs.append(
            subprocess.Popen(
                [str(bin_dir / "dialog-worker"), command],
                env=venv_env,
                cwd=app,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        log.close()
    try:
        gateway = f"http://127.0.0.1:{gateway_port}"
        console = f"http://127.0.0.1:{console_port}"
        wait_until(lambda: status(f"{gateway}/healthz") == 200, 30, what="the gateway up")
        wait_until(lambda: status(f"{console}/healthz") == 200, 30, what="the console up")
        assert status(f"{gateway}/sessions/s1/events") == 401
        assert status(f"{console}/") == 401
        # docker-compose.yml's health checks of both services, with the image's python.
        compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
        for name in ("serve", "console"):
            command = compose["services"][name]["healthcheck"]["test"]
            assert command[:2] == ["CMD", "python"]
            check = [str(bin_dir / "python"), *command[2:]]
            assert subprocess.run(check, env=venv_env, timeout=30).returncode == 0, name
            closed = {**venv_env, "DIALOG_HTTP_PORT": "1", "DIALOG_CONSOLE_PORT": "1"}
            failed = subprocess.run(check, env=closed, capture_output=True, timeout=30)
            assert failed.returncode != 0, f"{name}: the health check must be able to fail"
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


# ---------------------------------------------------------------------------------------------
# docker-compose.yml


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_file_matches_the_compose_specification_schema(compose: dict[str, Any]) -> None:
    pytest.importorskip("check_jsonschema")
    import jsonschema

    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads((vendored / "compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert [e.message for e in validator.iter_errors(compose)] == []
    broken = copy.deepcopy(compose)
    broken["services"]["worker"]["depends_on"]["redis"]["condition"] = "service_happy"
    assert list(validator.iter_errors(broken)), "the schema check must be able to fail"


def volume_map(service: dict[str, Any]) -> dict[str, str]:
    """Mount target -> source for the short syntax `source:target[:mode]`."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        mounts[target] = source
    return mounts


def test_compose_services_redis_worker_prometheus_grafana(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"redis", "worker", "prometheus", "grafana"} <= set(services)

    redis_svc = services["redis"]
    command = redis_svc["command"]
    command = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
    pairs = dict(zip(command[1::2], command[2::2], strict=False))
    assert command[0] == "redis-server"
    assert pairs["--appendonly"] == "yes" and pairs["--appendfsync"] == "everysec"
    assert pairs["--maxmemory-policy"] == "noeviction"
    assert redis_svc["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    data = volume_map(redis_svc)["/data"]
    assert data in compose["volumes"], "redis data must be a named volume"

    worker = services["worker"]
    assert worker["build"] == "."
    assert "container_name" not in worker, "--scale needs containers without fixed names"
    assert "ports" not in worker, "--scale needs replicas without a fixed host port"
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    env = {k: str(v) for k, v in worker["environment"].items()}
    assert env["REDIS_URL"] == "redis://redis:6379/0"
    check_env_names(env, "docker-compose.yml worker")
    grace = float(env.get("DIALOG_SHUTDOWN_GRACE_S", DEFAULTS.shutdown_grace_s))
    assert seconds(worker["stop_grace_period"]) > grace
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert env["DIALOG_METRICS_HOST"] == "0.0.0.0"


# Settings that hold secrets: in compose they come from the environment (or .env), never a value.
SECRET_SETTINGS = {
    "DIALOG_HTTP_TOKEN",
    "DIALOG_HTTP_SIGNING_KEY",
    "DIALOG_CONSOLE_OPERATORS",
    "DIALOG_CONSOLE_VIEWERS",
}


def test_compose_serve_and_console_take_their_secrets_from_the_environment_only(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    ports = {"serve": "DIALOG_HTTP_PORT", "console": "DIALOG_CONSOLE_PORT"}
    for name, port_setting in ports.items():
        service = services[name]
        assert service["profiles"] == ["web"], "opt-in: plain `up` starts no web service"
        assert service["command"] == [name]
        assert service["image"] == services["worker"]["image"] and service["build"] == "."
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        env = {k: str(v) for k, v in service["environment"].items()}
        assert env["REDIS_URL"] == "redis://redis:6379/0"
        secrets = {k: v for k, v in env.items() if k in SECRET_SETTINGS}
        assert secrets and all(v == f"${{{k}:-}}" for k, v in secrets.items()), secrets
        # Names checked; values given by the environment checked as unset.
        check_env_names({k: "" if v.startswith("${") else v for k, v in env.items()}, name)
        [published] = service["ports"]
        host, host_port, container_port = published.split(":")
        assert host_port == container_port, "the documented port on the host too"
        assert host == "127.0.0.1", "published on the loopback only: a proxy goes in front"
        assert container_port == env[port_setting]
        assert (
            "%s/healthz' % os.environ['" + port_setting + "']" in service["healthcheck"]["test"][-1]
        )
        assert service.get("stop_signal", "SIGTERM") == "SIGTERM"
    http = services["serve"]["environment"]
    assert {"DIALOG_HTTP_TOKEN", "DIALOG_HTTP_SIGNING_KEY"} <= set(http)
    assert http["DIALOG_HTTP_HOST"] == "0.0.0.0"
    assert services["console"]["environment"]["DIALOG_CONSOLE_HOST"] == "0.0.0.0"


def test_compose_prometheus_scrapes_every_worker_replica(compose: dict[str, Any]) -> None:
    services = compose["services"]
    prometheus = services["prometheus"]
    assert prometheus["image"].startswith("prom/prometheus")
    mounts = volume_map(prometheus)
    config_path = "/etc/prometheus/prometheus.yml"
    assert mounts[config_path] == "./config/prometheus.yml"
    assert f"--config.file={config_path}" in prometheus.get("command", [])
    host_files = {t: REPO / s for t, s in mounts.items() if s.startswith("./")}
    assert all(p.is_file() for p in host_files.values()), host_files
    config = yaml.safe_load(host_files[config_path].read_text())
    for rule_file in config.get("rule_files", []):
        assert str(Path(config_path).parent / rule_file) in host_files, f"{rule_file} not mounted"
    port = int(services["worker"]["environment"].get("DIALOG_METRICS_PORT", 8000))
    discovered = [
        (name, sd["port"])
        for job in config["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    ]
    assert ("worker", port) in discovered


def test_compose_grafana_is_provisioned_with_the_dashboard(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = {t: REPO / s for t, s in volume_map(grafana).items() if s.startswith("./")}
    assert all(p.exists() for p in mounts.values()), mounts
    provisioning = "/etc/grafana/provisioning"
    datasources = [p for t, p in mounts.items() if t.startswith(f"{provisioning}/datasources/")]
    providers = [p for t, p in mounts.items() if t.startswith(f"{provisioning}/dashboards/")]
    assert datasources and providers, "grafana reads provisioning/<kind>/*.yml only"
    urls = [d["url"] for f in datasources for d in yaml.safe_load(f.read_text())["datasources"]]
    assert "http://prometheus:9090" in urls
    paths = [
        p["options"]["path"] for f in providers for p in yaml.safe_load(f.read_text())["providers"]
    ]
    dashboards = [t for t, p in mounts.items() if p.suffix == ".json"]
    assert dashboards and all(any(d.startswith(f"{p}/") for p in paths) for d in dashboards)


# ---------------------------------------------------------------------------------------------
# Kubernetes


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted((REPO / "deploy" / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return docs


def test_kubernetes_core_objects_validate_against_the_openapi_schema(
    manifests: dict[str, dict[str, Any]],
) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = "1.30.0"
    core = {k: d for k, d in manifests.items() if not d["apiVersion"].startswith("keda.sh/")}
    assert {"Deployment", "Service", "PodDisruptionBudget", "Ingress"} <= {
        d["kind"] for d in core.values()
    }
    assert {"Deployment/dialog-gateway", "Deployment/dialog-console"} <= core.keys()
    for doc in core.values():
        kubernetes_validate.validate(doc, version, strict=True)
    broken = copy.deepcopy(core["Deployment/dialog-worker"])
    broken["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "forty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_kubernetes_deployment_probes_grace_and_security(
    manifests: dict[str, dict[str, Any]],
) -> None:
    deployment = manifests["Deployment/dialog-worker"]
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    plain = {n: e["value"] for n, e in env.items() if "value" in e}
    check_env_names(plain, "deployment.yaml")
    assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"]["key"] == "REDIS_URL"
    assert "value" not in env["REDIS_URL"], "the URL holds the password: Secret only"
    grace = float(plain.get("DIALOG_SHUTDOWN_GRACE_S", DEFAULTS.shutdown_grace_s))
    assert pod["terminationGracePeriodSeconds"] > grace

    port = int(plain.get("DIALOG_METRICS_PORT", DEFAULTS.metrics_port))
    named = {p["name"]: p["containerPort"] for p in container["ports"]}

    def probe(kind: str) -> tuple[str, int]:
        get = container[kind]["httpGet"]
        return get["path"], named.get(get["port"], get["port"])

    assert probe("readinessProbe") == ("/readyz", port)
    assert probe("livenessProbe") == ("/healthz", port)
    assert plain["DIALOG_METRICS_HOST"] == "0.0.0.0"

    security = {**pod.get("securityContext", {}), **container["securityContext"]}
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    _, stages = dockerfile_stages()
    assert str(security["runAsUser"]) == stages[-1].last("USER").split(":")[0]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"] and container["resources"]["limits"]


def test_kubernetes_service_pdb_and_keda_scaledobject(manifests: dict[str, dict[str, Any]]) -> None:
    deployment = manifests["Deployment/dialog-worker"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()

    service = manifests["Service/dialog-worker"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"].get("clusterIP") == "None"  # one DNS record per pod
    assert [p["port"] for p in service["spec"]["ports"]] == [DEFAULTS.metrics_port]

    pdb = manifests["PodDisruptionBudget/dialog-worker"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "maxUnavailable" in pdb["spec"] or "minAvailable" in pdb["spec"]

    [scaled] = [d for d in manifests.values() if d["kind"] == "ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    target = scaled["spec"]["scaleTargetRef"]
    assert (target.get("kind", "Deployment"), target["name"]) == ("Deployment", "dialog-worker")
    assert 1 <= scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]
    [trigger] = scaled["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "redis-streams"
    # XLEN mode (KEDA uses it when no consumerGroup is given): the group's lag is nil in
    # XINFO GROUPS whenever finished entries were deleted at its position, and KEDA reads
    # nil as 0 (see test_operator_tools.py for the nil case).
    assert meta["stream"] == DEFAULTS.stream and "consumerGroup" not in meta
    assert str(meta["streamLength"]).isdigit() and int(meta["streamLength"]) > 0
    assert all(isinstance(v, str) for v in meta.values()), "KEDA metadata values are strings"
    auth = manifests[f"TriggerAuthentication/{trigger['authenticationRef']['name']}"]
    refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
    assert {"address", "username", "password"} <= set(refs)
    assert all(r["name"] and r["key"] for r in refs.values())


@pytest.mark.parametrize(
    ("name", "command", "port_setting", "secrets"),
    [
        ("dialog-gateway", "serve", "DIALOG_HTTP_PORT", {"DIALOG_HTTP_SIGNING_KEY"}),
        ("dialog-console", "console", "DIALOG_CONSOLE_PORT", {"DIALOG_CONSOLE_OPERATORS"}),
    ],
)
def test_kubernetes_gateway_and_console_take_secrets_and_probe_their_own_port(
    manifests: dict[str, dict[str, Any]],
    name: str,
    command: str,
    port_setting: str,
    secrets: set[str],
) -> None:
    deployment = manifests[f"Deployment/{name}"]
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["args"] == [command]
    worker = manifests["Deployment/dialog-worker"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == worker["image"], "one image for every service"
    env = {e["name"]: e for e in container["env"]}
    plain = {n: e["value"] for n, e in env.items() if "value" in e}
    check_env_names(plain, f"{name} deployment")
    from_secret = {n for n, e in env.items() if "valueFrom" in e}
    assert {"REDIS_URL", *secrets} <= from_secret
    assert from_secret.isdisjoint(plain), "a secret never has a value in the file"
    refs = {env[n]["valueFrom"]["secretKeyRef"]["name"] for n in from_secret}
    assert refs == {name}, "each service reads its own Secret (its own Redis user)"
    for secret in SECRET_SETTINGS & env.keys():
        assert secret in from_secret, f"{secret} in plain text"
    port = int(plain[port_setting])
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for kind in ("readinessProbe", "livenessProbe"):
        get = container[kind]["httpGet"]
        assert (get["path"], named.get(get["port"], get["port"])) == ("/healthz", port)
    security = {**pod["securityContext"], **container["securityContext"]}
    assert security["runAsNonRoot"] is True and security["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["automountServiceAccountToken"] is False
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = manifests[f"Service/{name}"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    # Neither is picked up by the worker's Service, PDB or autoscaler.
    workers = manifests["Deployment/dialog-worker"]["spec"]["selector"]["matchLabels"]
    assert not workers.items() <= labels.items()


def _ingress_forwards(rule: dict[str, Any], path: str) -> bool:
    """Whether an Ingress path rule sends ``path`` on (Kubernetes' matching: ``Exact``, or
    ``Prefix`` element by element, so ``/ai-sdk/`` takes ``/ai-sdk/chat`` but not
    ``/ai-sdk-x``)."""
    if rule["pathType"] == "Exact":
        return bool(path == rule["path"])
    prefix = [e for e in rule["path"].split("/") if e]
    return [e for e in path.split("/") if e][: len(prefix)] == prefix


def _bytes(size: str) -> int:
    """An NGINX size (``128k``, ``1m``) in bytes."""
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    return int(size[:-1]) * units[size[-1].lower()] if size[-1].isalpha() else int(size)


def test_kubernetes_ingress_forwards_every_front_door_unbuffered_and_never_metrics(
    manifests: dict[str, dict[str, Any]],
) -> None:
    from dialog_worker.gateway import ai_sdk, openapi
    from dialog_worker.gateway.app import create_app

    ingress = manifests["Ingress/dialog-gateway"]
    [rule] = ingress["spec"]["rules"]
    paths = rule["http"]["paths"]
    for path in paths:
        backend = path["backend"]["service"]
        assert backend["name"] == "dialog-gateway" and backend["port"]["name"] == "http"
    # Every route the gateway serves, mounts included, read from the app itself: a door added
    # later fails here until the Ingress sends it on.
    app = create_app(load_settings(environ={}), "t0ken")
    served = {route for _, route, _ in openapi.endpoints(list(app.routes))}
    assert {"/ai-sdk/chat", "/langgraph/info", "/openapi.json", "/metrics"} <= served
    kept_in = {r for r in served if not any(_ingress_forwards(p, r) for p in paths)}
    assert kept_in == {"/metrics", "/healthz"}
    assert [t["hosts"] for t in ingress["spec"]["tls"]] == [[rule["host"]]]
    notes = ingress["metadata"]["annotations"]
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    # Longer than a connection's 10 minutes: the gateway ends it, not the proxy.
    assert int(notes["nginx.ingress.kubernetes.io/proxy-read-timeout"]) > 600
    # useChat's whole conversation passes: the gateway, not the proxy, says what is too large.
    assert _bytes(notes["nginx.ingress.kubernetes.io/proxy-body-size"]) >= ai_sdk.MAX_BODY_BYTES


# ---------------------------------------------------------------------------------------------
# scripts/container-check.sh (the image built and run with podman; .ci/run runs it after pytest)


def test_ci_runs_the_container_check_after_the_test_suite() -> None:
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    [pytest_line] = [i for i, line in enumerate(ci) if "-m pytest" in line]
    assert ci.index("bash scripts/container-check.sh") > pytest_line
    subprocess.run(["bash", "-n", str(REPO / "scripts" / "container-check.sh")], check=True)
    host = REPO / "scripts" / "container_check_host.py"
    subprocess.run([sys.executable, "-m", "py_compile", str(host)], check=True, timeout=30)


def test_container_check_uses_the_host_network_only() -> None:
    """A bridge network's private-range addresses must never receive traffic on these machines:
    every container the check starts is on the host network, and it never creates a network."""
    script = (REPO / "scripts" / "container_check_host.py").read_text()
    code = [line for line in script.splitlines() if "--network=" not in line]  # the guards
    modes = re.findall(r'"--network",\s*"([^"]+)"', "\n".join(code))
    assert modes and set(modes) == {"host"}, modes
    # Every podman run/build names it: the worker containers, the id check, the build, the
    # sender and verifier (in_image), the own bot's build, its engine import check and its
    # wrong-engine run.
    assert len(modes) == 7 and 'in_image = ["--network", "host"' in script
    assert not re.search(r'"network",\s*"create"', script)
    assert 'netns = "host"' in script  # podman's default for anything not given --network
    assert "network_mode: host" in script  # every compose service


def test_docs_commands_name_files_that_exist() -> None:
    doc = (REPO / "docs" / "deploy.md").read_text()
    for command in (
        "docker compose up -d --build --scale worker=4",
        "kubectl -n dialog apply -f deploy/kubernetes/",
        "scripts/install-wheel.sh /opt/dialog-worker",
        "--aclfile /etc/redis/users.acl",
    ):
        assert command in doc
    for path in re.findall(r"`((?:deploy|config|scripts|docs)/[\w./-]+\.\w+)`", doc):
        assert (REPO / path).exists(), f"docs/deploy.md names a missing file: {path}"
