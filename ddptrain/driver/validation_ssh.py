"""The run's validations on a listed SSH host (``ValidationConfig(host=...)``).

:func:`validation_host` finds the host in the run's host list. :class:`SSHValidationHost`
runs each validation there over one SSH connection (:mod:`ddptrain.launch.ssh_process`), with
the host's own settings (user, port, key, ``python``, ``workdir``) and the environment the
run's agents get there. The request goes into a private folder on the host by SFTP; a
checkpoint on this machine's file system is copied into that folder too, unless the host sees
the run directory (it reads the run's ``run.json`` with this run's id, as the launcher decides
for workers); one on remote storage (``s3://...``) is passed as it is. The process on the host
imports ddptrain from the host's installation, as the agent does (never from the working
directory), and the driver's ``sys.path`` is merged with the host's as for the workers.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import cloudpickle

from ddptrain import _env
from ddptrain.checkpoint import Checkpoint
from ddptrain.driver.gpu_env import set_gpu_defaults
from ddptrain.driver.validation import Process, parse_result
from ddptrain.errors import ConfigError
from ddptrain.launch.hosts import HostSpec, is_local
from ddptrain.launch.ssh_files import HostFiles
from ddptrain.launch.ssh_process import SSHHost, SSHProcess
from ddptrain.wire.boot import PIN, versions

__all__ = ["SSHValidationHost", "validation_host"]

_CLEANUP_WAIT_S = 10.0  # at the end of the run, for the last validation's folder to be removed


def validation_host(name: str | None, hosts: list[HostSpec] | None) -> HostSpec | None:
    """The host of the run's host list named ``name`` (as written there); ``None`` for the
    driver's host (no name, or a name of this machine that is run without SSH).

    Raises:
        ConfigError: The run has no host list, or none of its hosts has that name, or the
            host is a SLURM node (reached with ``srun``, not SSH).
    """
    if name is None:
        return None
    if hosts is None:
        raise ConfigError(
            f"`ValidationConfig(host={name!r})` names a host, but the run has no host list: give "
            "`ScalingConfig(hosts=...)` (or $DDPTRAIN_HOSTFILE) with that host, or leave `host` out "
            "to validate on this machine."
        )
    for host in hosts:
        if host.name == name:
            if host.srun:
                raise ConfigError(
                    f"`ValidationConfig(host={name!r})` names a node of the SLURM allocation; validations run "
                    "on this machine or on an SSH host of a host list. Leave `host` out."
                )
            return None if is_local(host) else host
    raise ConfigError(
        f"`ValidationConfig(host={name!r})` is not one of the run's hosts "
        f"({', '.join(h.name for h in hosts)}). Give the name as the host list writes it."
    )


class SSHValidationHost:
    """A listed SSH host where the run's validations run, one at a time.

    Args:
        host: The host (after ``~/.ssh/config`` lookups); its ``python`` and ``workdir`` are the
            driver's ``sys.executable`` and working directory unless it gives them, as for its agent.
        env_vars: The run's environment of workers on other hosts (``worker_runtime_env``, the
            storage's credentials); with the forwarded variables of the driver's
            (``DDPTRAIN_FORWARD_ENV``), what the agents get there.
        uses_gpu: Leave the host's GPUs visible to the function (its ``gpus=`` if the host list
            gives them), else ``CUDA_VISIBLE_DEVICES=""``.
        probe: The run's ``run.json`` and the run's id: a host that reads that id there sees the
            run directory (no copy of a checkpoint is needed).

    Raises:
        ConfigError: A variable of the environment cannot be passed to a host.
    """

    def __init__(
        self,
        host: HostSpec,
        env_vars: dict[str, str],
        uses_gpu: bool = False,
        probe: tuple[str, str] | None = None,
    ) -> None:
        env = {**_env.forwarded_env(), **env_vars}
        env.setdefault("OMP_NUM_THREADS", "1")
        # The process there ends itself after this much silence from the driver (`ssh_process`).
        env["DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S"] = f"{_env.ssh_heartbeat_timeout_s():g}"
        if not uses_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        else:
            set_gpu_defaults(env, gpus_per_worker=1)  # `gpus=` ids are in PCI bus order
            if host.gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in host.gpus)
        self.name = host.name
        self.workdir = host.workdir or os.getcwd()
        self._host = SSHHost(host, env, host.python or sys.executable, self.workdir)
        self._probe = probe
        self._shared: bool | None = None  # whether the host sees the run directory, once asked
        self._last: SSHProcess | None = None

    def start(self, request: dict[str, Any], log: str) -> Process:
        # On the host: the driver's sys.path merged with the host's own, '' meaning `workdir` there.
        request = {**request, "cwd": self.workdir}

        def setup(files: HostFiles, folder: str) -> dict[str, bytes]:
            checkpoint = request["checkpoint"]
            if checkpoint._fs is None and not self._sees_run_dir(files):
                copy = f"{folder}/checkpoint"
                files.push_dir(checkpoint.path, copy)
                checkpoint = Checkpoint(copy)
            return {"task.pkl": cloudpickle.dumps({**request, "checkpoint": checkpoint})}

        def program(folder: str) -> list[str]:
            expected = versions(with_torch=False)  # checked there before the request is unpickled
            code = (
                "from ddptrain.driver.validation_child import main; "
                f"sys.exit(main({folder!r}, remote=True, expected={expected!r}))"
            )
            return [self._host.python, "-c", PIN + code]  # the working directory is off sys.path

        process = SSHProcess(self._host, "validation", setup, program, log, "result.json")
        self._last = process
        return _SSHValidation(process, self.name, log)

    def close(self) -> None:
        """Close the connection, once the last validation's folder is removed from the host
        (bounded: one whose host stopped answering keeps it; the process there removes it itself
        once its stdin ends)."""
        if self._last is not None:
            self._last.wait(_CLEANUP_WAIT_S)
        self._host.close()

    def _sees_run_dir(self, files: HostFiles) -> bool:
        """Whether the host reads this run's id in its ``run.json`` (asked once; a failed
        connection raises, and the next validation asks again)."""
        if self._shared is None:
            shared = False
            if self._probe is not None:
                path, run_id = self._probe
                try:
                    shared = json.loads(files.read_file(path) or b"{}").get("run_id") == run_id
                except (ValueError, AttributeError):
                    pass
            self._shared = shared
        return self._shared


class _SSHValidation:
    def __init__(self, process: SSHProcess, host: str, log: str) -> None:
        self.process = process
        self.host = host
        self.log = log

    def __str__(self) -> str:
        return f"on host {self.host!r}"

    def ended(self) -> bool:
        return self.process.ended()

    def kill(self, grace_s: float) -> None:
        # Its stdin closes: it stops its group with SIGTERM, and SIGKILL after the same grace.
        self.process.kill(grace_s + 2.0)

    def outcome(self) -> tuple[dict[str, Any] | None, str]:
        process = self.process
        if process.error is not None:
            return None, f"The validation did not run to its end on host {self.host!r}: {process.error.rstrip('.')}."
        how = "was ended by a signal" if process.returncode is None else f"exited with code {process.returncode}"
        return parse_result(process.result), (
            f"The validation process on host {self.host!r} {how} without a result; see {self.log}."
        )
