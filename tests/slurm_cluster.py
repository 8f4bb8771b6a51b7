"""A real SLURM cluster on this host for the tests: munged, slurmctld and two slurmd daemons that
emulate two nodes (n1, n2) on loopback, with their state, logs and slurm.conf in one temporary folder.

Needs root (munged runs as user ``munge``, slurmd starts jobs as their user) and Debian's
``slurm-wlm`` and ``munge`` (``tests/install_slurm.sh`` installs them). Where that is missing the
``slurm_cluster`` fixture skips with the reason; under CI (``CI=true``) it fails instead, so that a
broken bring-up cannot pass unnoticed. Only the daemons started here are stopped, by process id.

Use: import the fixture into a test module (``from tests.slurm_cluster import slurm_cluster``) and
call ``slurm_cluster.sbatch("submit_multinode.sh", "comm_check.py", options=["--gpus-per-node=0"])``.
"""

from __future__ import annotations

import itertools
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DAEMONS = {name: Path("/usr/sbin") / name for name in ("munged", "slurmctld", "slurmd")}
CLIENTS = ("sbatch", "scontrol", "sinfo", "squeue", "scancel")
INSTALL_HINT = "run `bash tests/install_slurm.sh` as root (Debian packages slurm-wlm, munge)"


class ClusterUnavailable(RuntimeError):
    """SLURM cannot run here; the message says why."""


@dataclass(repr=False)
class JobResult:
    """What ``sbatch --wait`` returned, and what the job wrote (stdout and stderr, one file)."""

    returncode: int
    job_id: int | None
    output: str
    sbatch_output: str

    @property
    def report(self) -> str:
        """For assertion messages: how sbatch ended and the end of the job's output."""
        return (f"sbatch exited {self.returncode} (job {self.job_id})\n--- sbatch\n{self.sbatch_output}"
                f"\n--- job output (last 6000 characters)\n{self.output[-6000:]}")


def unavailable_reason() -> str | None:
    """Why a local cluster cannot be brought up here, or None if it can be tried."""
    if os.geteuid() != 0:
        return "bringing up SLURM needs root (munged runs as user munge, slurmd as root)"
    missing = [str(path) for path in DAEMONS.values() if not path.exists()]
    missing += [name for name in CLIENTS if shutil.which(name) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): {INSTALL_HINT}"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return f"user munge does not exist: {INSTALL_HINT}"
    return None


def _free_port_block(count: int) -> int:
    """First of ``count`` consecutive free TCP ports on loopback, below the ephemeral range and
    away from 29500-30499, where submit_multinode.sh puts its rendezvous ports."""
    for _ in range(200):
        base = random.randrange(20000, 28000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise ClusterUnavailable(f"found no {count} consecutive free ports between 20000 and 28000")


class LocalSlurmCluster:
    """munged + slurmctld + one slurmd per emulated node, all on this host. ``start()``, ``stop()``."""

    def __init__(self, nodes: int = 2, cpus_per_node: int = 2):
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus_per_node = cpus_per_node
        self.root: Path | None = None
        self._processes: dict[str, subprocess.Popen] = {}
        self._job_names: list[str] = []
        self._job_counter = itertools.count(1)

    # --- bring-up ------------------------------------------------------------------------------------

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def client_env(self, extra: dict | None = None) -> dict:
        """The caller's environment without any SLURM job variables, pointed at this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        return {**env, "SLURM_CONF": str(self.conf), **(extra or {})}

    def start(self, timeout: float = 60) -> None:
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        # Readable by user munge, which must reach its socket folder inside.
        self.root = Path(tempfile.mkdtemp(prefix="slurm-test-"))
        self.root.chmod(0o755)
        for folder in ("ctld", "logs", "jobs", *self.nodes):
            (self.root / folder).mkdir()
        self._start_munged()
        self._write_conf()
        self._launch("slurmctld", [DAEMONS["slurmctld"], "-D", "-c", "-f", self.conf])
        for node in self.nodes:
            self._launch(f"slurmd-{node}", [DAEMONS["slurmd"], "-D", "-N", node, "-f", self.conf])
        self._wait_until_idle(timeout)

    def _start_munged(self) -> None:
        munge = pwd.getpwnam("munge")
        folder = self.root / "munge"
        folder.mkdir()
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for path in (folder, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        self._launch("munged", [DAEMONS["munged"], "--foreground", f"--socket={self.munge_socket}",
                                f"--key-file={key}", f"--pid-file={folder / 'munged.pid'}",
                                f"--log-file={folder / 'munged.log'}", f"--seed-file={folder / 'munged.seed'}"],
                     user=munge.pw_uid, group=munge.pw_gid)
        self._wait_for(lambda: self.munge_socket.exists(), 15, "munged did not create its socket")

    def _write_conf(self) -> None:
        ctld_port = _free_port_block(1 + len(self.nodes))
        node_ports = ctld_port + 1
        host = socket.gethostname()
        nodes = f"n[1-{len(self.nodes)}]"
        settings = {
            "ClusterName": "swinirtest",
            "SlurmctldHost": f"{host}(127.0.0.1)",
            "SlurmctldPort": ctld_port,
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self.munge_socket}",
            "StateSaveLocation": self.root / "ctld",
            "SlurmdSpoolDir": self.root / "%n",
            "SlurmctldPidFile": self.root / "ctld" / "slurmctld.pid",
            "SlurmdPidFile": self.root / "%n" / "slurmd.pid",
            "SlurmctldLogFile": self.root / "logs" / "slurmctld.log",
            "SlurmdLogFile": self.root / "logs" / "slurmd-%n.log",
            # No cgroups or accounting: containers and CI machines often lack them.
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "AccountingStorageType": "accounting_storage/none",
            "MpiDefault": "none",
            "MailProg": "/bin/true",
            "SchedulerType": "sched/builtin",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            "ReturnToService": 2,
            # Impossible requests (too many nodes or CPUs) fail at submission instead of pending forever.
            "EnforcePartLimits": "ALL",
            # Trust the node lines below, not the hardware: both emulated nodes share this host's cores.
            "SlurmdParameters": "config_overrides",
            # sbatch --wait polls with growing sleeps capped by MinJobAge / 2: keep them at 2 s.
            "MinJobAge": 4,
        }
        lines = [f"{key}={value}" for key, value in settings.items()]
        lines.append(f"NodeName={nodes} NodeHostname={host} NodeAddr=127.0.0.1 "
                     f"Port={node_ports}-{node_ports + len(self.nodes) - 1} CPUs={self.cpus_per_node} "
                     f"RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=UNLIMITED State=UP OverSubscribe=YES")
        self.conf.write_text("\n".join(lines) + "\n")

    def _launch(self, name: str, command: list, **popen_kwargs) -> None:
        log = open(self.root / "logs" / f"{name}.out", "wb")
        # Own session: a Ctrl-C in the test terminal reaches pytest, which then tears down by pid.
        self._processes[name] = subprocess.Popen(
            [str(part) for part in command], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=self.client_env(), start_new_session=True, **popen_kwargs)
        log.close()

    def _wait_for(self, ready, timeout: float, failure: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [name for name, proc in self._processes.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"not ready after {timeout:.0f} s"
                raise ClusterUnavailable(f"{failure} ({why})\n{self.log_tail()}")
            time.sleep(0.2)

    def _wait_until_idle(self, timeout: float) -> None:
        def idle() -> bool:
            proc = subprocess.run(["sinfo", "--noheader", "--format=%T %D"], env=self.client_env(),
                                  capture_output=True, text=True, timeout=10)
            return proc.returncode == 0 and proc.stdout.split() == ["idle", str(len(self.nodes))]

        self._wait_for(idle, timeout, f"nodes {', '.join(self.nodes)} did not become idle")

    def log_tail(self, lines: int = 15) -> str:
        if self.root is None:
            return ""
        parts = []
        for log in sorted((self.root / "logs").glob("*")) + [self.root / "munge" / "munged.log"]:
            if log.exists():
                text = log.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)

    # --- jobs --------------------------------------------------------------------------------------------

    def sbatch(self, script: str, *args: str, options: tuple | list = (), env: dict | None = None,
               timeout: float = 180) -> JobResult:
        """``sbatch --wait [options] script args`` from the repo root; returns once the job has ended.

        ``env`` adds to the caller's environment, which sbatch passes on to the job. A job still running
        after ``timeout`` seconds is cancelled and raises AssertionError with its output so far.
        """
        name = f"swinirtest-{next(self._job_counter)}"
        output = self.root / "jobs" / f"{name}.out"
        self._job_names.append(name)
        command = ["sbatch", "--wait", f"--job-name={name}", f"--output={output}", *options, script, *args]
        try:
            proc = subprocess.run(command, cwd=REPO, env=self.client_env(env), capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            self._cancel([name])
            job_output = output.read_text(errors="replace") if output.exists() else ""
            raise AssertionError(f"job {name} still running after {timeout:.0f} s, cancelled\n"
                                 f"{job_output[-6000:]}") from None
        job_id = next((int(word) for word in proc.stdout.split() if word.isdigit()), None)
        job_output = output.read_text(errors="replace") if output.exists() else ""
        return JobResult(proc.returncode, job_id, job_output, (proc.stdout + proc.stderr).strip())

    def _cancel(self, names: list[str]) -> None:
        if names:
            subprocess.run(["scancel", f"--name={','.join(names)}"], env=self.client_env(),
                           capture_output=True, timeout=30)

    # --- teardown ----------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel this cluster's jobs, stop its daemons by process id, remove its folder."""
        if self._processes.get("slurmctld") and self._processes["slurmctld"].poll() is None:
            self._cancel(self._job_names)
            self._wait_no_jobs(timeout=20)
        # slurmd before slurmctld before munged: each needs the next one to shut down cleanly.
        for name in [*(f"slurmd-{node}" for node in self.nodes), "slurmctld", "munged"]:
            proc = self._processes.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def _wait_no_jobs(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = subprocess.run(["squeue", "--noheader", "--format=%i"], env=self.client_env(),
                                  capture_output=True, text=True, timeout=10)
            if proc.returncode != 0 or not proc.stdout.strip():
                return
            time.sleep(0.5)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def skip_or_fail(message: str) -> None:
    """Skip the test, or fail it under CI, where everything the tests need must be there."""
    if in_ci():
        pytest.fail(f"{message} (CI=true: this test must run in CI)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A started LocalSlurmCluster; skips where SLURM cannot run, fails instead under CI=true."""
    cluster = LocalSlurmCluster()
    try:
        cluster.start()
    except (ClusterUnavailable, OSError, subprocess.SubprocessError) as error:
        cluster.stop()
        skip_or_fail(f"local SLURM cluster unavailable: {error}")
    yield cluster
    cluster.stop()


def _stop_like_ctrl_c(signum, frame):
    # SIGTERM ends the wait as Ctrl-C does, so that the daemons are stopped either way.
    raise KeyboardInterrupt


def main() -> None:
    """Keep a cluster up for trying the scripts by hand: sudo .venv/bin/python -m tests.slurm_cluster"""
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"error: {reason}")
    cluster = LocalSlurmCluster()
    signal.signal(signal.SIGTERM, _stop_like_ctrl_c)
    try:
        cluster.start()
        print(f"SLURM is up: nodes {', '.join(cluster.nodes)} with {cluster.cpus_per_node} CPUs each, no GPU.\n"
              f"In another shell, from the repository root:\n"
              f"  export SLURM_CONF={cluster.conf}\n"
              f"  sinfo\n"
              f"  PYTHON_ENV=$PWD/.venv sbatch --wait --gpus-per-node=0 submit_multinode.sh comm_check.py "
              f"--max-bytes 16MiB\n"
              f"Ctrl-C here stops the cluster.", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    except ClusterUnavailable as error:
        raise SystemExit(f"error: {error}") from None
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
