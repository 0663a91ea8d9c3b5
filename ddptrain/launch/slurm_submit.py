"""Submitting a training script to SLURM from a login node: ``ddptrain submit`` and :func:`submit`.

:func:`submit` writes a batch script (a private file under ``~/.ddptrain/slurm``) that runs the
user's script under the allocation with ``DDPTRAIN_HOSTFILE=slurm`` (so ``hosts="slurm"`` is the
default of its trainers), submits it with ``sbatch``, prints the job's output as it grows, and
returns the script's exit status. Ctrl-C cancels the job (``scancel``).

Preemption and time limits: the job asks SLURM for ``SIGUSR1`` to the batch shell
``SlurmConfig.signal_s`` seconds before its end (``--signal=B:USR1@S``). The batch shell passes it
on to the driver as SIGTERM, which ``fit()`` takes as a preemption notice (the workers see
``get_preemption_info()`` and may report a final checkpoint; ``run.json`` says PREEMPTED). When the
driver then ends without success, the batch shell requeues the job (``scontrol requeue``, the job
is submitted with ``--requeue``); the requeued job runs the script again, and its trainers resume
the run by name: the batch script sets ``DDPTRAIN_RUN_NAME`` (the name of runs whose
``RunConfig`` gives none) to ``<job name>-<job id>``, which a requeue keeps. :func:`submit`
follows the job through its requeues until it ends.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from ddptrain.errors import ConfigError, LaunchError

__all__ = ["SlurmConfig", "batch_script", "submit", "warning_option"]

_logger = logging.getLogger(__name__)

_CLIENT_TIMEOUT_S = 30.0  # one sbatch / scontrol / scancel call
_POLL_S = 1.0  # between two looks at the job
_PENDING_REMIND_S = 60.0  # a pending job is reported again after this long
_CANCEL_WAIT_S = 60.0  # after scancel: how long we wait for the job to end
_ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
_JOB_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# sbatch's --signal=[{R|B}:]<sig_num>[@sig_time] asking for SIGUSR1 (the default time is 60 s).
_USR1_WARNING = re.compile(r"(?:[RB]{1,2}:)?(?:SIG)?(?:USR1|10)(?:@(\d+))?", re.IGNORECASE)


def warning_option(options: list[str]) -> tuple[int | None, list[str]]:
    """A ``--signal`` among sbatch ``options`` that asks for SIGUSR1 before the job's end, as
    Lightning's docs teach (``--signal=SIGUSR1@90``): its lead time in seconds, and ``options``
    without it. ``None`` (and ``options`` unchanged) when there is no ``--signal``, or it asks
    for another signal."""
    for index, option in enumerate(options):
        if option == "--signal" and index + 1 < len(options):
            value, end = options[index + 1], index + 2
        elif option.startswith("--signal="):
            value, end = option.split("=", 1)[1], index + 1
        else:
            continue
        match = _USR1_WARNING.fullmatch(value)
        if match is None:
            return None, options
        return int(match.group(1) or 60), options[:index] + options[end:]
    return None, options


@dataclass
class SlurmConfig:
    """The allocation a script is submitted to (``ddptrain submit`` / :func:`submit`).

    Args:
        nodes: Nodes of the job (``--nodes``).
        workers_per_node: Workers on each node (``--ntasks-per-node``); ``None``: from the GPUs
            (``use_gpu=True``) or the node's CPUs, as ``hosts="slurm"`` counts them.
        gpus_per_node: GPUs of each node (``--gpus-per-node``).
        partition: The partition (``--partition``).
        time: The time limit, in SLURM's form (``"04:00:00"``, ``"2-00:00:00"``).
        job_name: The job's name (``--job-name``); also the start of the run name the job's
            trainers use when their ``RunConfig`` gives none (``<job_name>-<job id>``).
        signal_s: Seconds before the time limit (or a preemption) at which SLURM warns the job
            with SIGUSR1: the run gets a preemption notice, reports a final checkpoint, and the
            job is requeued. ``0``: no warning, no requeue.
        extra: More ``sbatch`` options as on its command line, e.g. ``["--account=abc", "--qos=low"]``.
        output_dir: Where the batch script and the job's output file go (default
            ``~/.ddptrain/slurm``: a folder the login node and the batch host both see).

    Example:
        >>> config = SlurmConfig(nodes=2, workers_per_node=4, gpus_per_node=4, time="04:00:00")
    """

    nodes: int = 1
    workers_per_node: int | None = None
    gpus_per_node: int | None = None
    partition: str | None = None
    time: str | None = None
    job_name: str = "ddptrain"
    signal_s: int = 120
    extra: list[str] = field(default_factory=list)
    output_dir: str | None = None

    def __post_init__(self) -> None:
        for name, minimum in (("nodes", 1), ("workers_per_node", 1), ("gpus_per_node", 0), ("signal_s", 0)):
            value = getattr(self, name)
            if value is None and name in ("workers_per_node", "gpus_per_node"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"`SlurmConfig({name}=...)` must be an integer >= {minimum}, got {value!r}.")
        if not _JOB_NAME.fullmatch(self.job_name):
            raise ConfigError(
                f"`SlurmConfig(job_name=...)` must be 1-64 letters, digits, '_', '.' or '-', got {self.job_name!r}."
            )
        if not isinstance(self.extra, (list, tuple)) or not all(isinstance(o, str) for o in self.extra):
            raise ConfigError(f"`SlurmConfig(extra=...)` must be a list of sbatch options (str), got {self.extra!r}.")
        for option in self.extra:
            if self.signal_s and option.split("=", 1)[0] == "--signal":
                raise ConfigError(
                    f"`SlurmConfig(extra=[{option!r}, ...])` and `signal_s={self.signal_s}` both ask for a warning "
                    "signal: give its lead time as `signal_s` (the warning then preempts the run and requeues "
                    "the job), or set `signal_s=0` to send your own signal, with no requeue."
                )
            if option.split("=", 1)[0] in ("-o", "--output", "-e", "--error", "--open-mode"):
                raise ConfigError(
                    f"`ddptrain submit` writes the job's output itself (to follow it): leave out {option!r}, "
                    "or set `SlurmConfig(output_dir=...)`."
                )

    def sbatch_options(self) -> list[str]:
        """The options of the ``#SBATCH`` lines (``extra`` comes on the command line, after them)."""
        options = [f"--job-name={self.job_name}", f"--nodes={self.nodes}"]
        if self.workers_per_node is not None:
            options.append(f"--ntasks-per-node={self.workers_per_node}")
        if self.gpus_per_node is not None:
            options.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.partition is not None:
            options.append(f"--partition={self.partition}")
        if self.time is not None:
            options.append(f"--time={self.time}")
        if self.signal_s:
            options += [f"--signal=B:USR1@{self.signal_s}", "--requeue"]
        return options


# The batch script's body. The driver runs in the background so that the shell can pass
# SLURM's warning signal on to it (bash runs a trap only between commands: `wait` returns at
# once when the signal comes, and is called again until the driver has ended). The warning is
# USR1, not TERM: `scancel` (Ctrl-C) sends TERM, and a cancelled job must not requeue itself.
_BODY = """\
# Written by `ddptrain submit`: runs the script on the job's nodes (hosts="slurm").
cd {workdir} || exit 1
export DDPTRAIN_HOSTFILE=slurm
export DDPTRAIN_RUN_NAME="${{DDPTRAIN_RUN_NAME:-{job_name}-$SLURM_JOB_ID}}"
echo "ddptrain submit: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST" \
    "(run $DDPTRAIN_RUN_NAME, start ${{SLURM_RESTART_COUNT:-0}})"
warned=0
driver=
trap 'warned=1; echo "ddptrain submit: SLURM warning signal (USR1): preempting run $DDPTRAIN_RUN_NAME"; \
[ -n "$driver" ] && kill -TERM "$driver" 2>/dev/null' USR1
trap '[ -n "$driver" ] && kill -TERM "$driver" 2>/dev/null' TERM
{command} &
driver=$!
while :; do
    wait "$driver"
    status=$?
    kill -0 "$driver" 2>/dev/null || break
done
if [ "$warned" = 1 ] && [ "$status" != 0 ] && [ {requeue} = 1 ]; then
    echo "ddptrain submit: requeueing job $SLURM_JOB_ID: its next start resumes run $DDPTRAIN_RUN_NAME"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
fi
exit "$status"
"""


def batch_script(config: SlurmConfig, command: list[str], workdir: str, output: str) -> str:
    """The text of the batch script that runs ``command`` (``[script.py, args...]`` run with this
    Python, or a program) in ``workdir`` on the job's nodes, its output appended to ``output``."""
    if command and command[0].endswith(".py"):
        command = [sys.executable, *command]
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {option}" for option in config.sbatch_options()]
    lines += [f"#SBATCH --output={output}", "#SBATCH --open-mode=append"]
    body = _BODY.format(
        workdir=shlex.quote(workdir),
        job_name=config.job_name,
        command=" ".join(shlex.quote(arg) for arg in command),
        requeue=1 if config.signal_s else 0,
    )
    return "\n".join(lines) + "\n" + body


def _client(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """A SLURM client command, bounded by ``_CLIENT_TIMEOUT_S``.

    Raises:
        LaunchError: It is not installed, or did not answer in time.
    """
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=_CLIENT_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False
        )
    except FileNotFoundError:
        raise LaunchError(f"`{argv[0]}` not found: `ddptrain submit` runs on a SLURM login node.") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"`{' '.join(argv[:3])}` did not answer in {_CLIENT_TIMEOUT_S:g} s (is slurmctld up?)"
        ) from None


def _job(job_id: str) -> dict[str, str] | None:
    """``scontrol show job``'s fields (``None``: SLURM no longer knows the job)."""
    done = _client(["scontrol", "-o", "show", "job", job_id])
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return None
        raise LaunchError(f"`scontrol show job {job_id}` failed: {done.stderr.strip()}")
    fields: dict[str, str] = {}
    for match in re.finditer(r"(\w+)=(\S*)", done.stdout):
        fields.setdefault(match.group(1), match.group(2))
    return fields


class _Tail:
    """Prints what is appended to a file (the job's output) from where it stopped last time."""

    def __init__(self, out: IO[str]) -> None:
        self.path: str | None = None
        self._offset = 0
        self._out = out

    def pump(self) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        if data:
            self._offset += len(data)
            self._out.write(data.decode(errors="replace"))
            self._out.flush()


def _say(text: str) -> None:
    print(f"ddptrain submit: {text}", file=sys.stderr, flush=True)


def _follow(job_id: str, tail: _Tail, clock: Callable[[], float] = time.monotonic) -> int:
    """Print the job's output until it has ended (through its requeues); its exit status."""
    said: tuple[str, str] | None = None
    said_at = 0.0
    unreachable_since: float | None = None
    while True:
        try:
            job = _job(job_id)
        except LaunchError as exc:  # slurmctld busy or restarting: the job goes on; so do we
            if unreachable_since is None or clock() - unreachable_since > _PENDING_REMIND_S:
                _say(f"cannot ask SLURM about job {job_id} ({exc}); trying again (Ctrl-C cancels the job)")
                unreachable_since = clock()
            tail.pump()
            time.sleep(_POLL_S)
            continue
        unreachable_since = None
        if job is not None and job.get("StdOut") and tail.path is None:
            tail.path = job["StdOut"]
        tail.pump()
        if job is None:  # purged already (SLURM keeps an ended job for MinJobAge, 300 s by default)
            _say(f"SLURM no longer knows job {job_id}: its exit status is unknown")
            return 1
        state, reason = job.get("JobState", "?"), job.get("Reason", "None")
        if state in _ENDED:
            tail.pump()
            code, _, sig = job.get("ExitCode", "1:0").partition(":")
            status = int(code) if code.isdigit() else 1
            if state != "COMPLETED" or status:
                why = f" ({reason})" if reason not in ("None", "") else ""
                _say(
                    f"job {job_id} ended: {state}{why}, exit status {status}"
                    + (f", signal {sig}" if sig not in ("", "0") else "")
                )
            if sig not in ("", "0") and not status:
                status = 128 + int(sig) if sig.isdigit() else 1
            return status if state == "COMPLETED" or status else 1
        if state == "PENDING" and ((state, reason) != said or clock() - said_at > _PENDING_REMIND_S):
            _say(f"job {job_id} is pending in the queue ({reason}); waiting for it to start (Ctrl-C cancels it)")
            said, said_at = (state, reason), clock()
        elif state != "PENDING" and said is not None and said[0] != state:
            _say(f"job {job_id} is {state.lower()}")
            said, said_at = (state, reason), clock()
        elif said is None:
            said, said_at = (state, reason), clock()
        time.sleep(_POLL_S)


def _cancel(job_id: str, tail: _Tail) -> None:
    """``scancel`` the job and wait (at most ``_CANCEL_WAIT_S``) until SLURM says it ended."""
    _say(f"Ctrl-C: cancelling job {job_id} (scancel); waiting up to {_CANCEL_WAIT_S:g} s for it to end")
    done = _client(["scancel", job_id])
    if done.returncode != 0:
        _say(f"`scancel {job_id}` failed: {done.stderr.strip()}")
        return
    deadline = time.monotonic() + _CANCEL_WAIT_S
    while time.monotonic() < deadline:
        tail.pump()
        job = _job(job_id)
        if job is None or job.get("JobState") in _ENDED:
            tail.pump()
            _say(f"job {job_id} cancelled")
            return
        time.sleep(_POLL_S)
    _say(f"job {job_id} was cancelled but had not ended after {_CANCEL_WAIT_S:g} s; see `squeue -j {job_id}`")


def submit(command: list[str], config: SlurmConfig | None = None, workdir: str | None = None) -> int:
    """Submit ``command`` (``["train.py", "--lr", "0.1"]``: a script run with this Python, or a
    program) to SLURM as a batch job, print its output as it runs, and return its exit status.

    The job runs ``command`` once, on its first node; its trainers run their workers on every
    node of the job (``DDPTRAIN_HOSTFILE=slurm``). Ctrl-C cancels the job. With
    ``config.signal_s``, a time limit or preemption warning stops the run with a final
    checkpoint and requeues the job, which resumes the run (see the module docstring); the job is
    followed through its requeues.

    Args:
        command: The script and its arguments.
        config: The allocation (default: one node).
        workdir: The job's working directory (default: this one).

    Raises:
        ConfigError: ``command`` is empty, or its script is not in ``workdir``.
        LaunchError: ``sbatch`` refused the job, or SLURM's clients are missing or do not answer.

    Example:
        >>> status = ddptrain.submit(["train.py"], ddptrain.SlurmConfig(nodes=2, time="01:00:00"))  # doctest: +SKIP
    """
    config = config or SlurmConfig()
    if not command:
        raise ConfigError("`submit` needs a command: the script and its arguments, e.g. ['train.py'].")
    workdir = os.path.abspath(workdir or os.getcwd())
    script = os.path.join(workdir, os.path.expanduser(command[0]))
    if command[0].endswith(".py") and not os.path.isfile(script):  # said now, not by the job in the queue
        raise ConfigError(f"no such script: {script} (the job runs `{command[0]}` in {workdir}).")
    folder = os.path.abspath(os.path.expanduser(config.output_dir or "~/.ddptrain/slurm"))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    output = os.path.join(folder, f"{config.job_name}-%j.out")
    text = batch_script(config, list(command), workdir, output)
    fd, path = tempfile.mkstemp(prefix=f"{config.job_name}-", suffix=".sbatch", dir=folder)  # mode 0600
    with os.fdopen(fd, "w") as f:
        f.write(text)
    done = _client(["sbatch", "--parsable", *config.extra, path])
    if done.returncode != 0:
        raise LaunchError(f"sbatch refused the job (exit status {done.returncode}): {done.stderr.strip()}")
    job_id = done.stdout.strip().split(";")[0]
    _say(f"submitted batch job {job_id} (script {path})")
    tail = _Tail(sys.stdout)
    tail.path = output.replace("%j", job_id)
    try:
        return _follow(job_id, tail)
    except KeyboardInterrupt:
        _cancel(job_id, tail)
        return 130
