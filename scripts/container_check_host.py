"""The host side of scripts/container-check.sh: build the container image and run it for real,
with podman instead of a Docker engine (docs/deploy.md, "Building and running the image without
Docker", says why each step is shaped so).

    bash scripts/container-check.sh        # as root, on Debian 12; .ci/run runs it after pytest

The shell script only bounds the whole run in time and starts this file. Steps:
  1. install podman, buildah, runc, mmdebstrap, redis-server, curl (apt) and podman-compose
     1.6.0 (PyPI, into a venv under ~/.cache) when missing;
  2. build two local base images with mmdebstrap from the Debian mirror the host's apt uses
     (no registry is reachable): python3 + venv + pip, and redis-server for compose;
  3. build the project image from the Dockerfile (PYTHON_IMAGE=the local base);
  4. check it: uid 10001, HEALTHCHECK kept, /healthz 200 at once, /readyz 503 until a
     redis-server on loopback answers and 200 after, `podman healthcheck run` healthy;
  5. a burst of 500 messages over 50 sessions through three worker containers, SIGTERM
     (`podman stop`) to one of them mid-burst: it exits 0 within the shutdown grace, every
     message is applied exactly once and in order (scripts/container_check.py, in the image);
  6. your own bot: examples/own_bot/Dockerfile built FROM the project image (the recipe of
     docs/deploy.md), and a wrong DIALOG_ENGINE stops it at once (exit 2, naming it);
  7. `podman-compose --profile web up` of docker-compose.yml (redis, the worker on the own
     bot's image, serve and console, with an override: local images, host network, loopback
     ports; their secrets from the environment, as a .env file gives them): a send and a state
     through the worker, a page's round trip through the gateway with a token minted by
     `dialog-worker token` in its container (401 without it, 403 on another session, the
     own bot's answer streamed word by word, its turn on /events), the console behind its
     sign-in; every service stops with exit 0; `down -v`.
Everything runs in a private podman store under a temporary folder with host networking only:
no bridge or CNI network is ever created, containers talk to 127.0.0.1 only. On every exit path
the containers, pods, volumes, images, the redis-server and the folder are removed. The last
line is "containers: N passed, M failed"; exit 0 only when nothing failed.

Environment: CONTAINER_CHECK_TIMEOUT_S (the hard limit, applied by the shell script; named in
the message when it stops us), CONTAINER_CHECK_DEBIAN_MIRROR (a mirror URL or sources file for
mmdebstrap; default: the host's Debian sources).

`python3 container_check_host.py build-own-bot DIR ARCHIVE [TAG]` (scripts/build-own-bot.sh) runs
steps 1-3 and 6 for the bot in DIR (its Dockerfile FROM the project image, as
examples/own_bot's), checks that its DIALOG_ENGINE imports in the image, and saves the image as
ARCHIVE (a docker archive: `podman load -i ARCHIVE` or `docker load -i ARCHIVE`), tagged TAG
(default localhost/mybot:latest). Everything else it made is removed, as by the check.

`python3 container_check_host.py compose-override COMPOSE OUT REDIS_IMAGE IMAGE BOT_IMAGE
REDIS_PORT METRICS_PORT HTTP_PORT CONSOLE_PORT` writes the compose override; it needs PyYAML, so
it runs with podman-compose's venv interpreter (the host's python3 may not have it).
"""

from __future__ import annotations

import base64
import glob
import json
import os
import re
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any, NoReturn

REPO = Path(__file__).resolve().parent.parent
PC_VERSION = "1.6.0"
PC_VENV = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path(os.environ.get("HOME") or "/root") / ".cache")
    / "dialog-worker"
    / f"podman-compose-{PC_VERSION}"
)
BURST_SESSIONS = 50
BURST_MESSAGES = 10
WORKER_GRACE_S = 10  # DIALOG_SHUTDOWN_GRACE_S of the burst's workers
STOP_OVERHEAD_S = 3  # what `podman stop` itself may add to the worker's own exit time
PROJECT = "dialog-worker-check"
CHECK_PY = "/opt/dialog-check/container_check.py"
OWN_BOT = REPO / "examples" / "own_bot"
WEB_SERVICES = ("redis", "worker", "serve", "console")
TOOLS = {  # command: the Debian package that has it
    "podman": "podman",
    "buildah": "buildah",
    "runc": "runc",
    "mmdebstrap": "mmdebstrap",
    "redis-server": "redis-server",
    "redis-cli": "redis-tools",
    "curl": "curl",
}


class Failed(Exception):
    """A check failed: the run ends (later steps build on earlier ones)."""

    def __init__(self, name: str, detail: str = "") -> None:
        super().__init__(f"{name}: {detail}" if detail else name)


class Check:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.run_id = os.getpid()
        self.image = f"localhost/dialog-worker:check-{self.run_id}"
        self.base_image = f"localhost/dialog-worker-base:check-{self.run_id}"
        self.redis_image = f"localhost/dialog-worker-redis:check-{self.run_id}"
        self.bot_image = f"localhost/mybot:check-{self.run_id}"
        self.work: Path | None = None
        self.redis: subprocess.Popen[bytes] | None = None
        self.background: list[subprocess.Popen[bytes]] = []
        self.compose_up = False
        self.interfaces_before: list[str] | None = None
        self.passed: list[str] = []
        self.failed: list[str] = []
        self.notes: list[str] = []
        self.env = dict(os.environ)

    # -- reporting ----------------------------------------------------------------------------

    def say(self, text: str) -> None:
        print(f"[container-check {time.monotonic() - self.started:6.1f}s] {text}", flush=True)

    def passes(self, name: str, detail: str = "") -> None:
        line = f"{name}: {detail}" if detail else name
        self.passed.append(line)
        self.say(f"PASS  {line}")

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.say(f"      {text}")

    def fail(self, name: str, detail: str = "") -> NoReturn:
        raise Failed(name, detail)

    def log(self, name: str) -> Path:
        assert self.work is not None
        return self.work / "logs" / f"{name}.log"

    def show_log(self, path: Path, lines: int = 40) -> None:
        if path.exists() and path.stat().st_size:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            print(f"----- last lines of {path.name} -----", *tail, "-----", sep="\n", flush=True)

    # -- running things -----------------------------------------------------------------------

    def step(self, name: str, args: Sequence[str], *, stdin: IO[bytes] | None = None) -> None:
        """Run with output to logs/NAME.log; on failure show its tail and fail."""
        with self.log(name).open("wb") as out:
            code = subprocess.run(
                list(args), stdout=out, stderr=subprocess.STDOUT, stdin=stdin, env=self.env
            ).returncode
        if code != 0:
            self.show_log(self.log(name))
            self.fail(name, f"command failed: {' '.join(args)}")

    def out(self, *args: str, timeout: float = 120) -> str:
        """A command's stdout, stripped; its stderr goes to logs/podman.log."""
        with self.log("podman").open("ab") as err:
            ran = subprocess.run(
                list(args), stdout=subprocess.PIPE, stderr=err, env=self.env, timeout=timeout
            )
        if ran.returncode != 0:
            raise subprocess.CalledProcessError(ran.returncode, args)
        return ran.stdout.decode(errors="replace").strip()

    def ok(self, *args: str, timeout: float = 120) -> bool:
        with self.log("podman").open("ab") as err:
            return (
                subprocess.run(
                    list(args), stdout=subprocess.DEVNULL, stderr=err, env=self.env, timeout=timeout
                ).returncode
                == 0
            )

    def podman(self, *args: str, timeout: float = 120) -> str:
        return self.out("podman", *args, timeout=timeout)

    def pc(self, *args: str) -> list[str]:
        assert self.work is not None
        return [
            str(PC_VENV / "bin" / "podman-compose"),
            "-p",
            PROJECT,
            "-f",
            str(REPO / "docker-compose.yml"),
            "-f",
            str(self.work / "compose.override.yml"),
            # Every command sees the services of the profile "web" (serve, console): without
            # it podman-compose knows no such service (exec, stop) and `down` leaves them.
            "--profile",
            "web",
            *args,
        ]

    # -- the run ------------------------------------------------------------------------------

    def main(self) -> int:
        """The whole check."""

        def check() -> None:
            self.prerequisites()
            self.configure_podman()
            self.base_images()
            self.build_image()
            self.own_bot(OWN_BOT, "mybot.worker:Bot")
            self.keep_own_bot(self.work_path("mybot.tar"), self.bot_image, reload=True)
            ports = free_ports(8)
            self.health_and_readiness(ports[:2])
            self.burst(f"redis://127.0.0.1:{ports[0]}/0", ports[0], ports[2:4])
            self.compose(*ports[4:8])

        return self.run(check)

    def build_own_bot(self, folder: Path, archive: Path, tag: str) -> int:
        """`build-own-bot`: the bot in ``folder`` built FROM the project image, checked, and
        kept as the docker archive ``archive`` (the rest is removed, as by the check)."""

        def build() -> None:
            self.prerequisites(compose=False)
            self.configure_podman()
            self.base_images(redis=False)
            self.build_image()
            self.own_bot(folder, None)
            self.keep_own_bot(archive, tag)

        return self.run(build)

    def run(self, steps: Callable[[], None]) -> int:
        def stopped(signum: int, frame: FrameType | None) -> None:
            limit = os.environ.get("CONTAINER_CHECK_TIMEOUT_S", "600")
            raise Failed("overall", f"stopped by a signal (the hard limit is {limit} s)")

        signal.signal(signal.SIGTERM, stopped)
        signal.signal(signal.SIGINT, stopped)
        interrupted = ""
        try:
            steps()
        except Failed as exc:
            self.failed.append(str(exc))
            self.say(f"FAIL  {exc}")
        except BaseException as exc:  # a bug of this script: still clean up and report
            traceback.print_exc()
            interrupted = f"{type(exc).__name__}: {exc}"
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            self.cleanup()
        if interrupted and not self.failed:
            self.failed.append(f"interrupted ({interrupted})")
        print()
        self.say(f"total {time.monotonic() - self.started:.1f} s")
        for n in self.notes:
            print(f"  note: {n}")
        for p in self.passed:
            print(f"  PASS {p}")
        for f in self.failed:
            print(f"  FAIL {f}")
        print(f"containers: {len(self.passed)} passed, {len(self.failed)} failed", flush=True)
        return 1 if self.failed else 0

    # 1. What it needs

    def prerequisites(self, compose: bool = True) -> None:
        if os.geteuid() != 0:
            self.fail("prerequisites", "must run as root (rootful podman, mmdebstrap in root mode)")
        if shutil.which("apt-get") is None:
            self.fail("prerequisites", "needs a Debian host with apt-get (Debian 12 tested)")
        self.codename = os_release().get("VERSION_CODENAME") or "bookworm"
        missing = [pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None]
        self.work = Path(tempfile.mkdtemp(prefix="dialog-container-check.", dir="/var/tmp"))
        (self.work / "logs").mkdir()
        if missing:
            self.say(f"installing {' '.join(missing)} (apt-get)")
            # Wait for apt's lock rather than fail: others may be installing on this machine.
            apt = ["apt-get", "-o", "DPkg::Lock::Timeout=180"]
            self.step("apt-update", [*apt, "update", "-qq"])
            self.env["DEBIAN_FRONTEND"] = "noninteractive"
            self.step(
                "apt-install",
                [*apt, "install", "-y", "-qq", "--no-install-recommends", *missing],
            )
        tools = [
            self.out("podman", "--version"),
            " ".join(self.out("buildah", "--version").split()[:3]),
            "runc " + self.out("runc", "--version").splitlines()[0].split()[2],
            "mmdebstrap " + self.out("mmdebstrap", "--version").split()[1],
        ]
        if compose:
            self.podman_compose()
            tools.append(f"podman-compose {PC_VERSION}")
        self.passes("install", ", ".join(tools))

    def podman_compose(self) -> None:
        # Debian's podman-compose (1.0.3) cannot run this compose file with an override.
        pc = PC_VENV / "bin" / "podman-compose"
        version = ""
        if pc.exists():
            version = subprocess.run(
                [str(pc), "--version"], capture_output=True, text=True, check=False
            ).stdout
        if f"podman-compose version {PC_VERSION}" not in version:
            self.say(f"installing podman-compose=={PC_VERSION} into {PC_VENV}")
            shutil.rmtree(PC_VENV, ignore_errors=True)
            self.step("podman-compose-venv", [sys.executable, "-m", "venv", str(PC_VENV)])
            self.step(
                "podman-compose-install",
                [
                    str(PC_VENV / "bin" / "pip"),
                    "install",
                    "-q",
                    "--disable-pip-version-check",
                    f"podman-compose=={PC_VERSION}",
                ],
            )

    def configure_podman(self) -> None:
        """Podman configured for these machines, for this run only (CONTAINERS_* point at files
        in the run's folder; /etc/containers is not touched):
        - runc, not crun: crun 1.8 rejects the kernel's hybrid cgroup layout; cgroupfs: no
          systemd.
        - default ulimits no higher than the machine's hard limits (podman's exceed them).
        - host network by default, and CNI configuration in the run's folder, so that podman
          never writes or uses a bridge network: a bridge's private-range addresses must never
          see traffic.
        - a private store: everything this run builds or starts is removed with the folder.
        - no unqualified registry: a short image name can never turn into a pull."""
        work = self.work
        assert work is not None
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        nproc = 32768 if nproc == resource.RLIM_INFINITY or nproc > 32768 else nproc
        for sub in ("storage", "run", "tmp", "cni", "volumes"):
            (work / sub).mkdir()
        (work / "containers.conf").write_text(
            f"""[containers]
netns = "host"
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]
[network]
network_config_dir = "{work}/cni"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{work}/tmp/events.log"
tmp_dir = "{work}/tmp"
volume_path = "{work}/volumes"
"""
        )
        (work / "storage.conf").write_text(
            f"""[storage]
driver = "overlay"
graphroot = "{work}/storage"
runroot = "{work}/run"
"""
        )
        (work / "registries.conf").write_text(
            'unqualified-search-registries = []\nshort-name-mode = "enforcing"\n'
        )
        self.env.update(
            CONTAINERS_CONF=str(work / "containers.conf"),
            CONTAINERS_STORAGE_CONF=str(work / "storage.conf"),
            CONTAINERS_REGISTRIES_CONF=str(work / "registries.conf"),
            BUILDAH_FORMAT="docker",  # the OCI format has no HEALTHCHECK: buildah would drop it
        )
        self.interfaces_before = interfaces()
        self.step("podman-info", ["podman", "info"])
        info = self.log("podman-info").read_text()
        if "name: runc" not in info:
            self.fail("podman", "runtime is not runc")
        if f"graphRoot: {work}/storage" not in info:
            self.fail("podman", "private store not in use")

    # 2. Local base images (mmdebstrap from the host's Debian mirror, then `podman import`)

    def mirror(self) -> str:
        if os.environ.get("CONTAINER_CHECK_DEBIAN_MIRROR"):
            return os.environ["CONTAINER_CHECK_DEBIAN_MIRROR"]
        deb822 = Path("/etc/apt/sources.list.d/debian.sources")
        if deb822.exists() and deb822.stat().st_size:
            return str(deb822)  # mmdebstrap takes the file as is
        try:
            for line in Path("/etc/apt/sources.list").read_text().splitlines():
                words = line.split()
                if words[:1] == ["deb"] and self.codename in words:
                    return next(w for w in words[1:] if "://" in w)
        except (OSError, StopIteration):
            pass
        return "http://deb.debian.org/debian"

    def debstrap(
        self, name: str, packages: str, hooks: list[str], changes: list[str], image: str
    ) -> None:
        """A minbase rootfs from mmdebstrap, piped into `podman import`."""
        assert self.work is not None
        mmdebstrap = [
            *"mmdebstrap --quiet --variant=minbase".split(),
            "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
            f"--include={packages}",
            *(f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "locale")),
            *hooks,
            self.codename,
            "-",
            self.mirror(),
        ]
        env = {**self.env, "TMPDIR": str(self.work / "tmp")}
        with self.log(name).open("wb") as log:
            strap = subprocess.Popen(mmdebstrap, stdout=subprocess.PIPE, stderr=log, env=env)
            assert strap.stdout is not None
            imported = subprocess.run(
                ["podman", "import", *changes, "-", image],
                stdin=strap.stdout,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
            strap.stdout.close()
            strap_code = strap.wait()
        if strap_code != 0 or imported.returncode != 0:
            self.show_log(self.log(name))
            self.fail(
                name, f"mmdebstrap exit {strap_code}, podman import exit {imported.returncode}"
            )

    def base_images(self, redis: bool = True) -> None:
        # The host may reach the package index through a TLS-intercepting proxy whose CA it
        # trusts (local certificates in /usr/local/share/ca-certificates): the builder stage's
        # pip needs the same trust. These are public certificates, copied into the local base.
        cas = sorted(glob.glob("/usr/local/share/ca-certificates/*.crt"))
        ca_hooks = (
            [
                '--customize-hook=mkdir -p "$1/usr/local/share/ca-certificates"',
                f"--customize-hook=copy-in {' '.join(cas)} /usr/local/share/ca-certificates/",
                '--customize-hook=chroot "$1" update-ca-certificates >/dev/null',
            ]
            if cas
            else []
        )
        t0 = time.monotonic()
        # What the Dockerfile expects of python:3.11-slim: `python` with pip (builder stage),
        # venv (install-wheel.sh), groupadd/useradd, CA certificates.
        self.debstrap(
            "base-python",
            "python3,python3-venv,python3-pip,python-is-python3,ca-certificates",
            ca_hooks,
            ["--change", 'CMD ["python3"]'],
            self.base_image,
        )
        self.base_py_s = time.monotonic() - t0
        if not redis:
            self.passes(
                "base images",
                f"python base {self.size_mb(self.base_image)} MB in {self.base_py_s:.1f} s "
                f"(mmdebstrap {self.codename} from {self.mirror()})",
            )
            return
        t0 = time.monotonic()
        # Stands in for redis:7 in docker-compose.yml: redis-server and redis-cli, WORKDIR /data.
        self.debstrap(
            "base-redis",
            "redis-server",
            ['--customize-hook=mkdir -p "$1/data" && chroot "$1" chown redis:redis /data'],
            [
                a
                for c in ("WORKDIR /data", "USER redis", 'CMD ["redis-server"]')
                for a in ("--change", c)
            ],
            self.redis_image,
        )
        self.base_redis_s = time.monotonic() - t0
        self.passes(
            "base images",
            f"python base {self.size_mb(self.base_image)} MB in {self.base_py_s:.1f} s, redis "
            f"{self.size_mb(self.redis_image)} MB in {self.base_redis_s:.1f} s (mmdebstrap "
            f"{self.codename} from {self.mirror()})",
        )

    def size_mb(self, image: str) -> int:
        return round(int(self.podman("image", "inspect", "--format", "{{.Size}}", image)) / 1e6)

    # 3. The project image, from the Dockerfile as it is (only the base is a build argument)

    def build_image(self) -> None:
        t0 = time.monotonic()
        build = ["--format", "docker", "--network", "host", "--tag", self.image]
        build += ["--build-arg", f"PYTHON_IMAGE={self.base_image}", str(REPO)]
        self.step("image-build", ["podman", "build", *build])
        self.image_s = time.monotonic() - t0
        self.image_mb = self.size_mb(self.image)
        self.passes("image build", f"{self.image} {self.image_mb} MB in {self.image_s:.1f} s")

    # 3b. Your own bot: the recipe of docs/deploy.md, FROM the image just built

    def own_bot(self, folder: Path, expected_engine: str | None) -> None:
        """The bot in ``folder`` (its Dockerfile, the recipe of docs/deploy.md) built FROM the
        image: it names its engine (``expected_engine`` when given), goes back to the image's
        user, and its engine imports in the image."""
        t0 = time.monotonic()
        build = ["--format", "docker", "--network", "host", "--tag", self.bot_image]
        build += ["--build-arg", f"BASE_IMAGE={self.image}", str(folder)]
        self.step("own-bot-build", ["podman", "build", *build])
        built_s = time.monotonic() - t0
        environment = self.podman(
            "image",
            "inspect",
            "--format",
            "{{range .Config.Env}}{{println .}}{{end}}",
            self.bot_image,
        ).splitlines()
        engine = next((e[14:] for e in environment if e.startswith("DIALOG_ENGINE=")), "")
        if not engine or expected_engine not in (None, engine):
            self.fail("own bot", f"DIALOG_ENGINE not set by the recipe: {environment!r}")
        user = self.inspect("image", "{{.Config.User}}", self.bot_image)
        if user != "10001:10001":
            self.fail("own bot", f"USER is {user!r}: the recipe must go back to 10001:10001")
        # The engine imports as the worker will import it (no Redis needed for that).
        imported = subprocess.run(
            [
                *["podman", "run", "--rm", "--network", "host"],
                *["--entrypoint", "/opt/dialog-worker/bin/python", self.bot_image, "-c"],
                "import os; from dialog_worker.engine.loading import load_engine; "
                "load_engine(os.environ['DIALOG_ENGINE'])",
            ],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=120,
        )
        if imported.returncode != 0:
            print(imported.stdout, imported.stderr, sep="\n", flush=True)
            self.fail("own bot", f"DIALOG_ENGINE={engine} does not load in the image")
        if expected_engine is None:
            self.passes(
                "own bot image",
                f"{folder}/Dockerfile FROM the image in {built_s:.1f} s "
                f"({self.size_mb(self.bot_image)} MB): DIALOG_ENGINE={engine} loads, USER "
                "10001:10001",
            )
            return
        # A wrong engine name stops the worker at start, with one line naming the setting
        # (nothing listens on port 1: it must stop before it needs Redis).
        wrong = subprocess.run(
            [
                *["podman", "run", "--rm", "--network", "host"],
                *["-e", "DIALOG_ENGINE=mybot.nope:Bot", "-e", "REDIS_URL=redis://127.0.0.1:1/0"],
                *["-e", "DIALOG_METRICS_PORT=0"],
                self.bot_image,
            ],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
        )
        if wrong.returncode != 2 or "DIALOG_ENGINE" not in wrong.stderr:
            print(wrong.stdout, wrong.stderr, sep="\n", flush=True)
            self.fail("own bot", f"a wrong DIALOG_ENGINE exited {wrong.returncode}, expected 2")
        self.passes(
            "own bot image",
            f"examples/own_bot/Dockerfile FROM the image in {built_s:.1f} s "
            f"({self.size_mb(self.bot_image)} MB): DIALOG_ENGINE=mybot.worker:Bot loads, USER "
            "10001:10001; DIALOG_ENGINE=mybot.nope:Bot exits 2 naming DIALOG_ENGINE",
        )

    def keep_own_bot(self, archive: Path, tag: str, reload: bool = False) -> None:
        """The bot's image saved as a docker archive (what `podman load` and `docker load`
        read) tagged ``tag``. ``reload``: then removed from the store and loaded back from the
        archive, which must give the same image (the check proves what build-own-bot keeps)."""
        registry = tag.split("/", 1)[0] if "/" in tag else ""
        name = tag if "." in registry or registry == "localhost" else f"localhost/{tag}"
        if name != self.bot_image:
            self.podman("tag", self.bot_image, name)
        built = self.inspect("image", "{{.Id}}", name)
        archive.unlink(missing_ok=True)  # podman save refuses to write over a file
        save = ["podman", "save", "--format", "docker-archive", "--output", str(archive), name]
        self.step("own-bot-save", save)
        if reload:
            self.podman("rmi", "--force", name)
            self.step("own-bot-load", ["podman", "load", "--input", str(archive)])
            if self.inspect("image", "{{.Id}}", name) != built:
                self.fail("own bot kept", "the archive loads as another image")
        self.passes(
            "own bot kept",
            f"{name} saved as {archive} ({archive.stat().st_size / 1e6:.0f} MB, a docker "
            "archive)" + (", loaded back as the same image" if reload else ""),
        )

    def work_path(self, name: str) -> Path:
        assert self.work is not None
        return self.work / name

    # 4. What the image declares, then one worker before and after Redis answers

    def inspect(self, what: str, fmt: str, name: str) -> str:
        return self.podman(*([what, "inspect"] if what else ["inspect"]), "--format", fmt, name)

    def health_and_readiness(self, ports: list[int]) -> None:
        redis_port, p1 = ports
        user = self.inspect("image", "{{.Config.User}}", self.image)
        health = self.inspect("image", "{{json .Config.Healthcheck}}", self.image)
        stopsignal = self.inspect("image", "{{.Config.StopSignal}}", self.image)
        if user != "10001:10001":
            self.fail("image config", f"USER is {user!r}, expected 10001:10001")
        if "/healthz" not in health:
            self.fail("image config", f"no HEALTHCHECK in the image ({health})")
        if stopsignal != "SIGTERM":
            self.fail("image config", f"STOPSIGNAL is {stopsignal!r}")
        uid = self.podman(
            "run", "--rm", "--network", "host", "--entrypoint", "id", self.image, "-u"
        )
        if uid != "10001":
            self.fail("image config", f"runs as uid {uid}")
        self.passes(
            "image config",
            f"USER 10001:10001 (id -u in a container: {uid}), HEALTHCHECK on /healthz, "
            "STOPSIGNAL SIGTERM",
        )
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        # Nothing listens on redis_port yet.
        t0 = time.monotonic()
        if not self.start_worker(1, p1):
            self.fail("health before Redis", "podman run failed")
        if not wait_until(30, lambda: http_code(f"http://127.0.0.1:{p1}/healthz") == 200):
            self.container_logs("check-w1")
            self.fail("health before Redis", "/healthz not 200 within 30 s")
        healthz_s = time.monotonic() - t0
        ready_before = http_code(f"http://127.0.0.1:{p1}/readyz")
        if ready_before != 503:
            self.fail(
                "health before Redis", f"/readyz {ready_before} while Redis is down, expected 503"
            )
        status = self.inspect("", "{{.State.Status}}", "check-w1")
        if status != "running":
            self.fail("health before Redis", f"container {status}")
        if not self.ok("podman", "healthcheck", "run", "check-w1"):
            self.fail("health before Redis", "podman healthcheck run: unhealthy")
        status_1 = self.podman("exec", "check-w1", "cat", "/proc/1/status")
        uid1 = next(
            (line.split()[1] for line in status_1.splitlines() if line.startswith("Uid:")), ""
        )
        if uid1 != "10001":
            self.fail("health before Redis", f"the worker process runs as uid {uid1}")
        self.passes(
            "health before Redis",
            f"/healthz 200 {healthz_s:.1f} s after podman run, /readyz 503, HEALTHCHECK "
            f"healthy, worker uid {uid1}",
        )
        assert self.work is not None
        self.redis = subprocess.Popen(
            [
                *f"redis-server --port {redis_port} --bind 127.0.0.1 --appendonly no".split(),
                *["--save", "", "--logfile", str(self.log("redis"))],
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.redis_port = redis_port
        if not wait_until(15, lambda: self.ok("redis-cli", "-p", str(redis_port), "ping")):
            self.fail("readiness", "redis-server did not start")
        t0 = time.monotonic()
        if not wait_until(30, lambda: http_code(f"http://127.0.0.1:{p1}/readyz") == 200):
            self.container_logs("check-w1")
            self.fail("readiness", "/readyz not 200 within 30 s of Redis answering")
        self.passes(
            "readiness",
            f"/readyz 200 {time.monotonic() - t0:.1f} s after redis-server on "
            f"127.0.0.1:{redis_port} answered",
        )

    def container_logs(self, name: str) -> None:
        logs = subprocess.run(
            ["podman", "logs", name], capture_output=True, text=True, env=self.env, check=False
        )
        print(*(logs.stdout + logs.stderr).splitlines()[-20:], sep="\n", flush=True)

    def mount_check_py(self) -> list[str]:
        return ["-v", f"{REPO}/scripts/container_check.py:{CHECK_PY}:ro"]

    def start_worker(self, n: int, port: int) -> bool:
        env = {
            "REDIS_URL": self.redis_url,
            "DIALOG_METRICS_HOST": "127.0.0.1",
            "DIALOG_METRICS_PORT": port,
            "DIALOG_SHUTDOWN_GRACE_S": WORKER_GRACE_S,
            "DIALOG_CONSUMER": f"check-w{n}",
            "DIALOG_ENGINE": "container_check:engine",
            "PYTHONPATH": "/opt/dialog-check",
        }
        args = ["run", "-d", "--name", f"check-w{n}", "--network", "host", *self.mount_check_py()]
        args += [arg for name, value in env.items() for arg in ("-e", f"{name}={value}")]
        return self.ok("podman", *args, self.image)

    # 5. Burst through three worker containers, SIGTERM to one of them mid-burst

    def replies(self) -> int:
        try:
            return int(self.out("redis-cli", "-p", str(self.redis_port), "xlen", "dialog-replies"))
        except (subprocess.CalledProcessError, ValueError):
            return 0

    def stop_worker(self, name: str) -> tuple[int, float]:
        t0 = time.monotonic()
        if not self.ok("podman", "stop", "--time", str(WORKER_GRACE_S + 20), name, timeout=60):
            self.fail("burst", f"podman stop {name} failed")
        return int(self.inspect("", "{{.State.ExitCode}}", name)), time.monotonic() - t0

    def burst(self, redis_url: str, redis_port: int, ports: list[int]) -> None:
        assert self.work is not None
        for n, port in zip((2, 3), ports, strict=True):
            if not self.start_worker(n, port):
                self.fail("burst", "podman run failed")
        for port in ports:
            if not wait_until(30, lambda p=port: http_code(f"http://127.0.0.1:{p}/readyz") == 200):
                self.fail("burst", f"worker on :{port} not ready")
        total = BURST_SESSIONS * BURST_MESSAGES
        t0 = time.monotonic()
        in_image = ["--network", "host", "-e", f"REDIS_URL={redis_url}", *self.mount_check_py()]
        in_image += ["--entrypoint", "python", self.image, CHECK_PY]
        with (self.work / "sent.json").open("wb") as sent, self.log("burst").open("wb") as err:
            sender = subprocess.Popen(
                [
                    *"timeout 240 podman run --rm --name check-burst".split(),
                    *in_image,
                    *f"burst --sessions {BURST_SESSIONS} --messages {BURST_MESSAGES}".split(),
                    *f"--prefix burst-{self.run_id} --timeout 150".split(),
                ],
                stdout=sent,
                stderr=err,
                env=self.env,
            )
        self.background.append(sender)
        if not wait_until(60, lambda: self.replies() >= total // 5 or sender.poll() is not None):
            self.fail("burst", f"fewer than {total // 5} replies after 60 s")
        at_stop = self.replies()
        # Evidence that the worker had work in hand (informational: metric names may change).
        metrics = http_text(f"http://127.0.0.1:{ports[0]}/metrics")
        in_flight = metric(metrics, "dialog_in_flight")
        applied = metric(metrics, 'dialog_messages_total{outcome="applied"}')
        if sender.poll() is not None:
            self.show_log(self.log("burst"))
            self.fail("burst", "the sender stopped early")
        if at_stop >= total:
            self.fail(
                "SIGTERM mid-burst", f"the burst was over ({at_stop} replies) before the SIGTERM"
            )
        code, stop_s = self.stop_worker("check-w2")
        after_stop = self.replies()
        if code != 0:
            self.container_logs("check-w2")
            self.fail("SIGTERM mid-burst", f"exit code {code}")
        if stop_s > WORKER_GRACE_S + STOP_OVERHEAD_S:
            self.fail("SIGTERM mid-burst", f"took {stop_s:.1f} s, grace is {WORKER_GRACE_S} s")
        self.passes(
            "SIGTERM mid-burst",
            f"podman stop of worker 2 at {at_stop}/{total} replies (it had applied {applied}, "
            f"{in_flight} in flight; {after_stop} replies when it had exited): exit 0 in "
            f"{stop_s:.1f} s (grace {WORKER_GRACE_S} s)",
        )
        if sender.wait() != 0:
            self.show_log(self.log("burst"))
            self.fail("burst", "not every message was applied (see burst.log)")
        burst_s = time.monotonic() - t0
        for name in ("check-w1", "check-w3"):
            code, _ = self.stop_worker(name)
            if code != 0:
                self.fail("burst", f"{name} exited {code}")
        with (self.work / "sent.json").open("rb") as sent_in:
            verify = ["verify", "--messages", str(BURST_MESSAGES)]
            self.step(
                "verify",
                [*"podman run --rm -i --name check-verify".split(), *in_image, *verify],
                stdin=sent_in,
            )
        summary = self.log("verify").read_text().strip().splitlines()[-1]
        self.passes(
            "burst exactly once, in order",
            f"{total} messages over {BURST_SESSIONS} sessions, 3 workers, applied in "
            f"{burst_s:.1f} s; {summary}",
        )

    # 7. docker-compose.yml through podman-compose: redis, the worker (the own bot), serve and
    #    console; a send, a state, a page's round trip, the console; stop; down -v

    def compose(
        self, redis_port: int, metrics_port: int, http_port: int, console_port: int
    ) -> None:
        assert self.work is not None
        override = self.work / "compose.override.yml"
        # The secrets, as a .env file or the shell would give them to `docker compose`.
        self.http_token = secrets.token_hex(16)
        self.signing_key = secrets.token_hex(32)
        self.console_token = secrets.token_hex(16)
        self.env.update(
            DIALOG_HTTP_TOKEN=self.http_token,
            DIALOG_HTTP_SIGNING_KEY=self.signing_key,
            DIALOG_CONSOLE_OPERATORS=f"check:{self.console_token}",
        )
        self.step(
            "compose-override",
            [
                str(PC_VENV / "bin" / "python"),
                __file__,
                "compose-override",
                str(REPO / "docker-compose.yml"),
                str(override),
                self.redis_image,
                self.image,
                self.bot_image,
                str(redis_port),
                str(metrics_port),
                str(http_port),
                str(console_port),
            ],
        )
        # Guard: what `up` would run, without running it. Every container on the host network,
        # and no network created.
        self.step(
            "compose-dry-run",
            self.pc("--verbose", "--dry-run", "up", "-d", "--no-build", *WEB_SERVICES),
        )
        dry = self.log("compose-dry-run").read_text()
        creates = dry.count("podman create ")
        if creates != len(WEB_SERVICES):
            self.show_log(self.log("compose-dry-run"))
            self.fail(
                "compose", f"dry run creates {creates} containers, expected {len(WEB_SERVICES)}"
            )
        starts = [ln for ln in dry.splitlines() if "podman create " in ln or "podman run " in ln]
        if any("--network=host" not in ln for ln in starts) or re.search(
            r"network create|--network=bridge", dry
        ):
            self.show_log(self.log("compose-dry-run"))
            self.fail("compose", "the override would not keep every container on the host network")

        self.compose_up = True
        self.step("compose-up", self.pc("up", "-d", "--no-build", *WEB_SERVICES))
        ready = f"http://127.0.0.1:{metrics_port}/readyz"
        if not wait_until(60, lambda: http_code(ready) == 200):
            self.show_log(self.log("compose-up"), 20)
            self.fail("compose", "worker not ready within 60 s")

        def container(service: str) -> str:
            names = self.podman(
                "ps",
                "-a",
                "--filter",
                f"label=io.podman.compose.project={PROJECT}",
                "--filter",
                f"label=io.podman.compose.service={service}",
                "--format",
                "{{.Names}}",
            )
            return names.splitlines()[0] if names else ""

        ctrs = {service: container(service) for service in WEB_SERVICES}
        worker_ctr = ctrs["worker"]
        for service in ("serve", "console"):
            port = http_port if service == "serve" else console_port
            if not wait_until(60, lambda p=port: http_code(f"http://127.0.0.1:{p}/healthz") == 200):
                self.container_logs(ctrs[service])
                self.fail("compose", f"{service} not answering /healthz within 60 s")
        for service, ctr in ctrs.items():
            if not self.ok("podman", "healthcheck", "run", ctr):
                self.fail("compose", f"{service} healthcheck unhealthy")
        session = f"compose-{self.run_id}"
        exec_cli = self.pc("exec", "-T", "worker", "dialog-worker")
        try:
            sent = self.out(*exec_cli, "send", session, "nama saya Budi", timeout=60)
            if json.loads(sent.splitlines()[0])["session_id"] != session:
                self.fail("compose", f"send printed {sent}")
        except (subprocess.CalledProcessError, ValueError, KeyError, IndexError):
            self.show_log(self.log("podman"))
            self.fail("compose", "dialog-worker send failed")
        last_state: list[Any] = [None]

        def state_applied() -> bool:
            try:
                state = json.loads(self.out(*exec_cli, "state", session, timeout=30))
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, ValueError):
                return False
            last_state[0] = state
            return bool(
                state
                and state["applied_seq"] == 1
                and state["memory"].get("turns") == 1
                and state["history"][0]["user"] == "nama saya Budi"
                and state["history"][0]["bot"] == "mybot heard: nama saya Budi (turn 1)"
            )

        if not wait_until(60, state_applied):
            self.fail("compose", f"state after send: {last_state[0]}")
        # The project's Redis command survived the override (only --port/--bind were added).
        cli = ["redis-cli", "-p", str(redis_port), "config", "get"]
        aof = self.out(*cli, "appendonly").splitlines()[-1]
        policy = self.out(*cli, "maxmemory-policy").splitlines()[-1]
        if (aof, policy) != ("yes", "noeviction"):
            self.fail("compose", f"redis runs with appendonly={aof} maxmemory-policy={policy}")
        web = self.web(http_port, console_port)
        t1 = time.monotonic()
        self.step("compose-stop", self.pc("stop", "worker"))
        code = self.inspect("", "{{.State.ExitCode}}", worker_ctr)
        if code != "0":
            self.fail("compose", f"worker exited {code} on stop")
        stop_s = time.monotonic() - t1
        self.step("compose-stop-web", self.pc("stop", "serve", "console"))
        for service in ("serve", "console"):
            code = self.inspect("", "{{.State.ExitCode}}", ctrs[service])
            if code != "0":
                self.fail("compose", f"{service} exited {code} on stop")
        self.step("compose-down", self.pc("down", "-v"))
        self.compose_up = False
        left = self.podman(
            "ps",
            "-a",
            "--filter",
            f"label=io.podman.compose.project={PROJECT}",
            "--format",
            "{{.Names}}",
        ).split()
        left += [
            v
            for v in self.podman("volume", "ls", "--format", "{{.Name}}").split()
            if v.startswith(f"{PROJECT}_")
        ]
        left += [
            p for p in self.podman("pod", "ls", "--format", "{{.Name}}").split() if PROJECT in p
        ]
        if left:
            self.fail("compose", f"left after down -v: {' '.join(left)}")
        self.passes(
            "compose",
            "podman-compose --profile web up redis worker serve console (worker on the own "
            "bot's image): ready, all four HEALTHCHECKs healthy, Redis AOF + noeviction; send + "
            f'state ("mybot heard: ..."); worker stop exit 0 in {stop_s:.1f} s, serve and '
            "console exit 0; down -v left nothing",
        )
        self.passes("serve and console", web)
        self.note(
            f"image {self.image_mb} MB; python base built in {self.base_py_s:.1f} s, redis base "
            f"in {self.base_redis_s:.1f} s, image in {self.image_s:.1f} s"
        )

    def web(self, http_port: int, console_port: int) -> str:
        """A page's round trip through the gateway, with a session token minted in the serve
        container (`dialog-worker token`, the Secret's signing key); the console's sign-in."""
        gateway = f"http://127.0.0.1:{http_port}"
        session = f"page-{self.run_id}"
        try:
            minted = json.loads(
                self.out(
                    *self.pc(
                        "exec", "-T", "serve", "dialog-worker", "token", session, "--ttl", "300"
                    ),
                    timeout=60,
                ).splitlines()[-1]
            )
            token = minted["token"]
        except (subprocess.CalledProcessError, ValueError, KeyError, IndexError):
            self.show_log(self.log("podman"))
            self.fail("serve", "dialog-worker token failed in the serve container")
        body = json.dumps({"text": "hello from a page"}).encode()
        bearer = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        codes = {
            "no token": http_post(f"{gateway}/sessions/{session}/messages", body, {})[0],
            "another session": http_post(f"{gateway}/sessions/x-{session}/messages", body, bearer)[
                0
            ],
        }
        if codes != {"no token": 401, "another session": 403}:
            self.fail("serve", f"refusals {codes}, expected 401 and 403")
        code, sent = http_post(f"{gateway}/sessions/{session}/messages", body, bearer)
        if code != 202:
            self.fail("serve", f"POST with the session token: {code} {sent}")
        stream = f"{gateway}{json.loads(sent)['stream']}?access_token={token}"
        events = sse_events(stream, "end", 60)
        deltas = [e for kind, e in events if kind == "delta"]
        end = events[-1][1] if events and events[-1][0] == "end" else {}
        answer = "mybot heard: hello from a page (turn 1)"
        if end.get("text") != answer or "".join(d["text"] for d in deltas) != answer:
            self.fail("serve", f"the streamed answer: {events[-3:]}")
        turns = sse_events(f"{gateway}/sessions/{session}/events?access_token={token}", "turn", 30)
        if [e.get("bot") for kind, e in turns if kind == "turn"] != [answer]:
            self.fail("serve", f"/events: {turns}")
        served = http_post(
            f"{gateway}/sessions/{session}/messages",
            json.dumps({"text": "from a server"}).encode(),
            {"Authorization": f"Bearer {self.http_token}", "Content-Type": "application/json"},
        )[0]
        if served != 202:
            self.fail("serve", f"the server token: {served}")
        console = f"http://127.0.0.1:{console_port}/"
        basic = base64.b64encode(f"check:{self.console_token}".encode()).decode()
        signed_in = http_code(console, {"Authorization": f"Basic {basic}"})
        if (http_code(console), signed_in) != (401, 200):
            self.fail("console", f"without sign-in {http_code(console)}, with {signed_in}")
        return (
            f"a session token from `dialog-worker token` in the serve container; 401 without "
            f"it, 403 on another session; 202, then the own bot's answer in {len(deltas)} "
            "deltas and its end, its turn on /events; the server token 202; the console 401, "
            "200 signed in"
        )

    # -- cleanup ------------------------------------------------------------------------------

    def cleanup(self) -> None:
        work = self.work
        if work is None:
            return
        self.say("cleaning up")
        for proc in self.background:
            if proc.poll() is None:
                proc.kill()
        with self.log("cleanup").open("ab") as log:

            def quietly(args: list[str], timeout: float) -> None:
                try:
                    subprocess.run(args, stdout=log, stderr=log, env=self.env, timeout=timeout)
                except (OSError, subprocess.TimeoutExpired) as exc:
                    log.write(f"{args}: {exc}\n".encode())

            if self.compose_up:
                quietly(self.pc("down", "-v", "-t", "5"), 90)
            # The store is private to this run: everything in it is ours.
            if "CONTAINERS_CONF" in self.env:
                quietly(["podman", "rm", "--all", "--force", "--time", "2"], 90)
                quietly(["podman", "pod", "rm", "--all", "--force"], 30)
                quietly(["podman", "volume", "rm", "--all", "--force"], 30)
                quietly(["podman", "rmi", "--all", "--force"], 90)
        if self.redis is not None and self.redis.poll() is None:
            self.redis.terminate()
            try:
                self.redis.wait(5)
            except subprocess.TimeoutExpired:
                self.redis.kill()
        # Mounts an interrupted build or container may have left inside the folder.
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for mount in sorted(
            (m for m in mounts if m == str(work) or m.startswith(f"{work}/")), reverse=True
        ):
            subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(work, ignore_errors=True)
        # Host network only: no interface (a bridge, a veth) may have appeared during the run.
        if self.interfaces_before is not None:
            new = sorted(set(interfaces()) - set(self.interfaces_before))
            if new:
                self.failed.append(
                    f"host network only: new network interfaces appeared: {' '.join(new)}"
                )


# -- small helpers ----------------------------------------------------------------------------


def os_release() -> dict[str, str]:
    fields = {}
    for line in Path("/etc/os-release").read_text().splitlines():
        key, _, value = line.partition("=")
        fields[key] = value.strip().strip('"')
    return fields


def interfaces() -> list[str]:
    return sorted(os.listdir("/sys/class/net"))


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_until(seconds: float, ready: Callable[[], bool]) -> bool:
    """Poll `ready` every 0.2 s until it is true; False at the deadline."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if ready():
                return True
        except (OSError, subprocess.SubprocessError):
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def http_code(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        request = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(request, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return 0


def http_post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (OSError, ValueError) as exc:
        return 0, str(exc)


def sse_events(url: str, last_kind: str, timeout_s: float) -> list[tuple[str, Any]]:
    """Server-sent events of ``url`` as (kind, data), up to the first of kind ``last_kind``
    (or until nothing came for ``timeout_s``)."""
    events: list[tuple[str, Any]] = []
    kind = ""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            for raw in response:
                line = raw.decode(errors="replace").rstrip("\r\n")
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: ") and kind:
                    events.append((kind, json.loads(line[6:])))
                    if kind == last_kind:
                        break
    except (OSError, ValueError):
        pass
    return events


def http_text(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return str(response.read().decode(errors="replace"))
    except (OSError, ValueError):
        return ""


def metric(text: str, name: str) -> str:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == name:
            return str(int(float(parts[1])))
    return "?"


def compose_override(
    compose_file: str,
    out: str,
    redis_image: str,
    image: str,
    bot_image: str,
    redis_port: str,
    metrics_port: str,
    http_port: str,
    console_port: str,
) -> None:
    """The override keeps the project's file as it is and changes only what these machines
    need: local images (never pulled or built; the worker runs the own bot's image, as
    docs/deploy.md says to), host network for every service, Redis on a free loopback port
    (the compose command plus --port/--bind, and its healthcheck on that port), the worker's
    metrics, the gateway and the console on free loopback ports (their published ports
    dropped: the host network has none to map). Their secrets stay as the file has them:
    interpolated from the environment."""
    import yaml  # podman-compose's venv has it

    with open(compose_file) as f:
        compose = yaml.safe_load(f)
    redis_cmd = [str(c) for c in compose["services"]["redis"]["command"]]
    redis_cmd += ["--port", redis_port, "--bind", "127.0.0.1"]
    j = json.dumps
    lines = [
        "# Written by scripts/container_check_host.py: local images, host network, loopback ports.",
        "services:",
        "  redis:",
        f"    image: {j(redis_image)}",
        "    pull_policy: never",
        "    network_mode: host",
        f"    command: !override {j(redis_cmd)}",
        "    healthcheck:",
        f"      test: !override {j(['CMD', 'redis-cli', '-p', redis_port, 'ping'])}",
        "  worker:",
        f"    image: {j(bot_image)}",
        "    pull_policy: never",
        "    network_mode: host",
        "    environment:",
        f"      REDIS_URL: {j(f'redis://127.0.0.1:{redis_port}/0')}",
        "      DIALOG_METRICS_HOST: 127.0.0.1",
        f"      DIALOG_METRICS_PORT: {j(metrics_port)}",
    ]
    for name, host, port in (
        ("serve", "DIALOG_HTTP_HOST", ("DIALOG_HTTP_PORT", http_port)),
        ("console", "DIALOG_CONSOLE_HOST", ("DIALOG_CONSOLE_PORT", console_port)),
    ):
        lines += [
            f"  {name}:",
            f"    image: {j(image)}",
            "    pull_policy: never",
            "    network_mode: host",
            "    ports: !reset []",
            "    environment:",
            f"      REDIS_URL: {j(f'redis://127.0.0.1:{redis_port}/0')}",
            f"      {host}: 127.0.0.1",
            f"      {port[0]}: {j(port[1])}",
        ]
    # Services this check does not start get host networking too, so that no service of the
    # project could ever land on a bridge, even if someone runs up without naming services.
    for name in compose["services"]:
        if name not in WEB_SERVICES:
            lines += [f"  {name}:", "    network_mode: host"]
    Path(out).write_text("\n".join(lines) + "\n")


def build_own_bot_args(argv: list[str]) -> tuple[Path, Path, str]:
    """``DIR ARCHIVE [TAG]`` of `build-own-bot`, checked before anything is installed or
    built: SystemExit(2) with one line on stderr when they cannot work."""

    def refuse(problem: str) -> NoReturn:
        print(f"build-own-bot: {problem}", file=sys.stderr)
        print("usage: scripts/build-own-bot.sh DIR ARCHIVE [TAG]", file=sys.stderr)
        raise SystemExit(2)

    if len(argv) not in (2, 3):
        refuse("expected the bot's folder and the archive to write")
    folder, archive = Path(argv[0]).resolve(), Path(argv[1]).resolve()
    tag = argv[2] if len(argv) == 3 else "mybot:latest"
    if not (folder / "Dockerfile").is_file():
        refuse(f"{folder} has no Dockerfile (examples/own_bot/ shows one)")
    if not archive.parent.is_dir():
        refuse(f"{archive.parent} is not a folder to write the archive in")
    if archive.is_relative_to(folder):
        refuse(f"{archive} is inside {folder}: the next build would copy it into the image")
    if not re.fullmatch(r"[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?", tag):
        refuse(f"{tag!r} is not an image name (lower case, optionally :tag)")
    return folder, archive, tag


if __name__ == "__main__":
    if sys.argv[1:2] == ["compose-override"]:
        compose_override(*sys.argv[2:11])
        sys.exit(0)
    if sys.argv[1:2] == ["build-own-bot"]:
        sys.exit(Check().build_own_bot(*build_own_bot_args(sys.argv[2:])))
    sys.exit(Check().main())
