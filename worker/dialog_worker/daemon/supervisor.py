"""`dialog-worker run --processes N`: one supervisor keeps N worker processes running on a host.

    children   `python -m dialog_worker run`, each in a process group of its own (a terminal's
               Ctrl-C reaches the supervisor alone, which forwards one SIGTERM), with the metrics
               port off and PROMETHEUS_MULTIPROC_DIR set to a fresh directory of this supervisor
    restart    a child that exits unasked is started again after a capped exponential backoff
               (`restart_delay_s`, reset once a child stayed up RESET_AFTER_S), each restart
               counted in dialog_worker_restarts_total; a dead child's live gauges are
               dropped (mark_process_dead), its counters kept so totals never go back
    give up    a child that died GIVE_UP_AFTER times in a row, each within QUICK_FAILURE_S of
               its start, cannot start (a broken engine, a refused setting): the supervisor
               stops the others and exits 1 naming that child's last stderr line
    HTTP       the supervisor alone binds DIALOG_METRICS_PORT: /metrics sums every child's
               metrics (MultiProcessCollector), /readyz is 200 only while every child is alive
               and reports dialog_ready 1 (the gauge has one series per live child)
    shutdown   SIGTERM/SIGINT: forwarded to every child, which finishes or hands back its work
               within DIALOG_SHUTDOWN_GRACE_S; children still running STOP_MARGIN_S after that
               are killed. Exit 0 when every child exited 0. A second signal is forwarded too
               (children exit at once, as on their own second signal) and the exit is 1.

A child watches its supervisor (`watch_supervisor`): if the supervisor dies without stopping
it (kill -9), the child stops itself gracefully instead of running on unsupervised.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import anyio
import anyio.abc
import structlog
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from dialog_worker.daemon.health_server import serve

log = structlog.get_logger("dialog_worker.daemon.supervisor")

SUPERVISOR_PID_ENV = "DIALOG_SUPERVISOR_PID"  # set for children; not a setting
RESTART_BASE_S = 0.5
RESTART_MAX_S = 30.0
RESET_AFTER_S = 60.0
STOP_MARGIN_S = 5.0
GIVE_UP_AFTER = 5  # quick failures in a row: 0.5 + 1 + 2 + 4 s of backoff between them
QUICK_FAILURE_S = 10.0
STDERR_TAIL_BYTES = 4096


class GaveUp(RuntimeError):
    """A child kept dying right after its start: restarting it again would only spin."""


def restart_delay_s(failures: int) -> float:
    """Wait before restarting a child that died `failures` times in a row: 0.5 s, 1 s, 2 s,
    ... at most 30 s, so a child that cannot start does not spin."""
    return min(RESTART_MAX_S, RESTART_BASE_S * 2.0 ** min(max(0, failures - 1), 16))


def cpu_count() -> int:
    """CPUs this process may run on (a container's cpuset, not the host's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclasses.dataclass(eq=False)
class Child:
    slot: int
    process: anyio.abc.Process | None = None
    started_at: float = 0.0
    failures: int = 0
    quick_failures: int = 0
    stderr_tail: bytes = b""

    @property
    def last_error(self) -> str:
        """The last non-blank line the child wrote on stderr ("" if none)."""
        lines = self.stderr_tail.decode("utf-8", "replace").splitlines()
        return next((line.strip() for line in reversed(lines) if line.strip()), "")

    @property
    def alive_pid(self) -> int | None:
        p = self.process
        return p.pid if p is not None and p.returncode is None else None


class Supervisor:
    def __init__(
        self,
        processes: int,
        *,
        child_env: Mapping[str, str],
        metrics_host: str,
        metrics_port: int,
        shutdown_grace_s: float,
        consumer: str | None,
    ) -> None:
        """`consumer`: the name given explicitly (children get `<name>-<slot>`), or None
        (each child names itself after its host and pid)."""
        self.metrics_host = metrics_host
        self.metrics_port = metrics_port
        self.shutdown_grace_s = shutdown_grace_s
        self.consumer = consumer
        self.children = [Child(i + 1) for i in range(processes)]
        self.child_env = dict(child_env)
        self.stopping = anyio.Event()
        self.forced = False
        self.gave_up: GaveUp | None = None
        self.metrics_dir = Path(tempfile.mkdtemp(prefix="dialog-worker-metrics-"))
        self.registry = CollectorRegistry()
        # prometheus_client.multiprocess has no type hints: the ignores below are for that.
        MultiProcessCollector(self.registry, path=str(self.metrics_dir))  # type: ignore[no-untyped-call]
        self.restarts = Counter(
            "dialog_worker_restarts",
            "Worker processes the supervisor started again after they died",
            registry=self.registry,
        )
        self._readiness = MultiProcessCollector(None, path=str(self.metrics_dir))  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------------------------

    async def run(self) -> int:
        http = None
        try:
            if self.metrics_port:  # bound first: a port in use stops us before any child starts
                http = serve(self.metrics_host, self.metrics_port, self.registry, self.ready)
                log.info("http_listening", host=self.metrics_host, port=http.port)
            log.info("supervisor_starting", processes=len(self.children))
            async with anyio.create_task_group() as side:
                side.start_soon(self._signals)
                side.start_soon(self._deadline)
                async with anyio.create_task_group() as children:
                    for child in self.children:
                        children.start_soon(self._keep_running, child)
                side.cancel_scope.cancel()
        finally:
            for child in self.children:  # only if we are leaving abnormally
                if child.alive_pid is not None and child.process is not None:
                    child.process.kill()
            if http is not None:
                http.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        codes = [c.process.returncode for c in self.children if c.process is not None]
        failed = self.forced or any(code != 0 for code in codes)
        log.info("supervisor_stopped", returncodes=codes)
        if self.gave_up is not None:
            raise self.gave_up
        return 1 if failed else 0

    def ready(self) -> bool:
        """Every child alive and reporting ready (called from the HTTP thread)."""
        if self.stopping.is_set():
            return False
        pids = {c.alive_pid for c in self.children}
        if None in pids:
            return False
        ready_pids = {
            int(sample.labels["pid"])
            for family in self._readiness.collect()  # type: ignore[no-untyped-call]
            if family.name == "dialog_ready"
            for sample in family.samples
            if sample.value == 1
        }
        return pids <= ready_pids

    # ------------------------------------------------------------------------------------

    async def _keep_running(self, child: Child) -> None:
        while not self.stopping.is_set():
            process = await anyio.open_process(
                [sys.executable, "-m", "dialog_worker", "run"],
                env=self._env_for(child),
                stdin=subprocess.DEVNULL,
                stdout=None,  # children log to our stdout
                stderr=subprocess.PIPE,  # passed on to ours, the last line kept (`last_error`)
                start_new_session=True,
            )
            child.process, child.started_at = process, time.monotonic()
            child.stderr_tail = b""
            log.info("worker_process_started", slot=child.slot, pid=process.pid)
            if self.stopping.is_set():  # the stop was forwarded while we started it
                process.send_signal(signal.SIGTERM)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._pass_stderr, child, process)
                returncode = await process.wait()
            # Its live gauges (ready, in flight, queue samples) must not count any more; its
            # counters and histograms stay, so totals never go back.
            mark_process_dead(process.pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
            if self.stopping.is_set():
                log.info(
                    "worker_process_stopped",
                    slot=child.slot,
                    pid=process.pid,
                    returncode=returncode,
                )
                return
            up_s = time.monotonic() - child.started_at
            child.failures = 1 if up_s >= RESET_AFTER_S else child.failures + 1
            child.quick_failures = child.quick_failures + 1 if up_s < QUICK_FAILURE_S else 0
            if child.quick_failures >= GIVE_UP_AFTER:
                self._give_up(child, returncode)
                return
            delay = restart_delay_s(child.failures)
            log.warning(
                "worker_process_died",
                slot=child.slot,
                pid=process.pid,
                returncode=returncode,
                up_s=round(up_s, 1),
                restart_in_s=delay,
                last_error=child.last_error,
            )
            self.restarts.inc()
            with anyio.move_on_after(delay):
                await self.stopping.wait()

    async def _pass_stderr(self, child: Child, process: anyio.abc.Process) -> None:
        assert process.stderr is not None
        async for chunk in process.stderr:
            sys.stderr.buffer.write(chunk)
            sys.stderr.buffer.flush()
            child.stderr_tail = (child.stderr_tail + chunk)[-STDERR_TAIL_BYTES:]

    def _give_up(self, child: Child, returncode: int) -> None:
        error = child.last_error.removeprefix("dialog-worker: ") or (
            f"exit code {returncode}, nothing on stderr"
        )
        log.error(
            "worker_process_gave_up",
            slot=child.slot,
            failures=child.quick_failures,
            returncode=returncode,
            last_error=error,
        )
        if self.gave_up is None:
            self.gave_up = GaveUp(
                f"worker process {child.slot} died {child.quick_failures} times in a row "
                f"within {QUICK_FAILURE_S:g} s of its start; giving up. Its last error: {error}"
            )
        self.stopping.set()
        self._send_all(signal.SIGTERM)

    def _env_for(self, child: Child) -> dict[str, str]:
        env = {
            **self.child_env,
            "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir),
            "DIALOG_METRICS_PORT": "0",
            SUPERVISOR_PID_ENV: str(os.getpid()),
        }
        if self.consumer:
            env["DIALOG_CONSUMER"] = f"{self.consumer}-{child.slot}"
        else:
            env.pop("DIALOG_CONSUMER", None)
        return env

    def _send_all(self, signum: signal.Signals) -> None:
        for child in self.children:
            if child.alive_pid is not None and child.process is not None:
                child.process.send_signal(signum)

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if self.stopping.is_set():
                    log.warning("second_signal_exit_now", signal=signum)
                    self.forced = True
                else:
                    log.info(
                        "shutdown_requested",
                        signal=signum,
                        grace_s=self.shutdown_grace_s,
                        processes=len(self.children),
                    )
                    self.stopping.set()
                self._send_all(signal.SIGTERM)

    async def _deadline(self) -> None:
        """After a stop, children get their grace period and a margin, then are killed."""
        await self.stopping.wait()
        await anyio.sleep(self.shutdown_grace_s + STOP_MARGIN_S)
        self.forced = True
        log.warning("worker_processes_killed", after_s=self.shutdown_grace_s + STOP_MARGIN_S)
        self._send_all(signal.SIGKILL)


def run_supervisor(supervisor: Supervisor) -> int:
    return int(anyio.run(supervisor.run))


def watch_supervisor(environ: Mapping[str, str] = os.environ) -> None:
    """In a child: SIGTERM ourselves once the supervisor that started us is gone, so a
    supervisor killed with -9 does not leave its children running unsupervised."""
    raw = environ.get(SUPERVISOR_PID_ENV)
    if not raw:
        return
    parent = int(raw)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        log.warning("supervisor_gone", supervisor_pid=parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()
