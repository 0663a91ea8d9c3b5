"""The one place that reads ``DDPTRAIN_*`` environment variables (driver and workers), and the
other libraries' variables ddptrain honours (RaySGD's ``NCCL_TIMEOUT_S``)."""

from __future__ import annotations

import os

__all__ = [
    "default_storage_path",
    "nccl_timeout_s",
    "report_warn_interval_s",
    "stall_warn_s",
    "shutdown_grace_s",
    "store_connect_timeout_s",
    "store_tamper_timeout_s",
    "channel_max_unread_mb",
    "storage_timeout_s",
    "worker_start_timeout_s",
    "loading_training_function",
    "console_ranks",
    "worker_start",
    "forwarded_env",
    "WORKER_MARKER",
    "OWN_GPUS",
]

# Set in every worker process, so that the library can tell it runs inside a worker.
WORKER_MARKER = "DDPTRAIN_WORKER"
# A worker that sees only its own GPUs: their numbers among the host's visible ones (taken out of
# the environment by the worker itself, which narrows CUDA_VISIBLE_DEVICES to them).
OWN_GPUS = "DDPTRAIN_OWN_GPUS"


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"`{name}` must be a number of seconds, got {raw!r}.") from None
    if value < 0:
        raise ValueError(f"`{name}` must be >= 0, got {raw!r}.")
    return value


def nccl_timeout_s() -> float | None:
    """RaySGD's ``NCCL_TIMEOUT_S``: the process group's timeout of a ``TorchTrainer`` (RaySGD's)
    on nccl; ``None`` when unset. Not a ``DDPTRAIN_*`` name: it is Ray's."""
    raw = os.environ.get("NCCL_TIMEOUT_S")
    if raw is None or raw.strip() == "":
        return None
    value = _float("NCCL_TIMEOUT_S", 0.0)
    if value <= 0:
        raise ValueError(f"`NCCL_TIMEOUT_S` must be a number of seconds > 0, got {raw!r}.")
    return value


def default_storage_path() -> str:
    """Where runs go when ``RunConfig.storage_path`` is not set."""
    return os.path.expanduser(os.environ.get("DDPTRAIN_STORAGE_PATH") or "~/ddptrain_results")


def cache_dir() -> str:
    """Where the driver keeps local working copies of runs on remote storage."""
    raw = os.environ.get("DDPTRAIN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ddptrain"
    )
    return os.path.abspath(os.path.expanduser(raw))


def report_warn_interval_s() -> float:
    """Seconds a rank may lag behind the others at a ``report()`` before it is named in a warning."""
    return _float("DDPTRAIN_REPORT_WARN_INTERVAL_S", 5.0)


def max_pending_uploads() -> int:
    """Checkpoint uploads (``CheckpointUploadMode.ASYNC``) a worker may have queued or running
    before its next ``report()`` with a checkpoint waits for the oldest one."""
    raw = os.environ.get("DDPTRAIN_MAX_PENDING_UPLOADS", "")
    if raw == "":
        return 2
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"`DDPTRAIN_MAX_PENDING_UPLOADS` must be a whole number >= 1, got {raw!r}.")
    return value


def upload_nice() -> int:
    """How much lower the CPU priority of a worker's upload process is than the worker's
    (``DDPTRAIN_UPLOAD_NICE``, an ``os.nice`` increment, 0 to 19)."""
    raw = os.environ.get("DDPTRAIN_UPLOAD_NICE", "")
    if raw == "":
        return 10
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ValueError(f"`DDPTRAIN_UPLOAD_NICE` must be a whole number from 0 to 19, got {raw!r}.")
    return value


def stall_warn_s() -> float:
    """Seconds without any report or output from any rank before the driver warns, with every
    rank's process state and Python stack."""
    return _float("DDPTRAIN_STALL_WARN_S", 30.0)


def validation_timeout_s() -> float:
    """How long one validation (``ValidationConfig``) may run before its process is killed
    (``DDPTRAIN_VALIDATION_TIMEOUT_S``, default 3600 s)."""
    return _float("DDPTRAIN_VALIDATION_TIMEOUT_S", 3600.0)


def validation_wait_s() -> float:
    """How long ``fit()`` waits, once training is done, for the validations still queued or
    running (``DDPTRAIN_VALIDATION_WAIT_S``, default 600 s); those not done then are killed."""
    return _float("DDPTRAIN_VALIDATION_WAIT_S", 600.0)


def validation_cpus() -> set[int] | None:
    """The CPUs a validation process is pinned to (``DDPTRAIN_VALIDATION_CPUS``, e.g. ``"3"``
    or ``"2-3"`` or ``"2,3"``; unset: no pinning)."""
    raw = os.environ.get("DDPTRAIN_VALIDATION_CPUS", "").strip()
    if not raw:
        return None
    cpus: set[int] = set()
    try:
        for part in raw.split(","):
            low, _, high = part.strip().partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ValueError(
            f"`DDPTRAIN_VALIDATION_CPUS` must be a CPU list such as '3' or '2-3' or '0,2', got {raw!r}."
        ) from None
    return cpus


def shutdown_grace_s() -> float:
    """Seconds workers get between SIGTERM and SIGKILL when the group is torn down."""
    return _float("DDPTRAIN_SHUTDOWN_GRACE_S", 3.0)


def preemption_window_s() -> float:
    """How long the workers have after a preemption notice to report a final checkpoint before
    the run stops (``DDPTRAIN_PREEMPTION_WINDOW_S``, default 30 s: a spot instance's shortest
    notice)."""
    value = _float("DDPTRAIN_PREEMPTION_WINDOW_S", 30.0)
    if value < 0:
        raise ValueError(f"`DDPTRAIN_PREEMPTION_WINDOW_S` must be >= 0 (seconds), got {value:g}.")
    return value


def elastic_min_workers_timeout_s() -> float:
    """How long an elastic run whose available hosts cannot hold ``min_workers`` waits for hosts
    it left out to answer again before it fails (``DDPTRAIN_ELASTIC_MIN_WORKERS_TIMEOUT_S``,
    default 120 s; 0 fails at once)."""
    value = _float("DDPTRAIN_ELASTIC_MIN_WORKERS_TIMEOUT_S", 120.0)
    if value < 0:
        raise ValueError(f"`DDPTRAIN_ELASTIC_MIN_WORKERS_TIMEOUT_S` must be >= 0 (seconds), got {value:g}.")
    return value


def warm_restarts() -> bool:
    """Whether a restart after a worker failure forks the next attempt's workers from the
    failed attempt's agents when they are alive (``DDPTRAIN_WARM_RESTARTS``, default 1; 0
    starts new agents every time)."""
    return os.environ.get("DDPTRAIN_WARM_RESTARTS", "1").strip() != "0"


def store_connect_timeout_s() -> float:
    """Seconds a worker waits to connect to the driver's store."""
    return _float("DDPTRAIN_STORE_CONNECT_TIMEOUT_S", 60.0)


def store_tamper_timeout_s() -> float:
    """Seconds the driver waits for a key of its store that something else deleted before the
    run fails (messages removed otherwise fail it within two heartbeats)."""
    return _float("DDPTRAIN_STORE_TAMPER_TIMEOUT_S", 30.0)


def channel_max_unread_mb() -> float:
    """MiB of worker messages the driver may hold before it has handled them; past it the run
    fails (a driver far behind its workers, or someone flooding its store)."""
    return _float("DDPTRAIN_CHANNEL_MAX_UNREAD_MB", 2048.0)


def storage_timeout_s() -> float:
    """Seconds a call to remote storage may go without an answer (a transfer: without progress)
    before it fails with a ``StorageError``.

    Raises:
        ValueError: The variable is not a number > 0.
    """
    value = _float("DDPTRAIN_STORAGE_TIMEOUT_S", 30.0)
    if value <= 0:
        raise ValueError("`DDPTRAIN_STORAGE_TIMEOUT_S` must be > 0: every call to remote storage needs a bound.")
    return value


def worker_start_timeout_s() -> float:
    """Seconds the driver waits for every worker to come up before it gives up."""
    return _float("DDPTRAIN_WORKER_START_TIMEOUT_S", 120.0)


def loading_training_function() -> bool:
    """Whether this process is unpickling a training function (an agent, before forking)."""
    return os.environ.get("DDPTRAIN_UNPICKLING") == "1"


def console_ranks() -> set[int] | None:
    """Ranks whose output is echoed to the driver's console (``None``: all), from
    ``DDPTRAIN_CONSOLE_RANKS`` such as ``"0"`` or ``"0,3"``."""
    raw = os.environ.get("DDPTRAIN_CONSOLE_RANKS", "").strip()
    if raw in ("", "all"):
        return None
    try:
        ranks = {int(part) for part in raw.split(",") if part.strip()}
    except ValueError:
        ranks = {-1}
    if not ranks or min(ranks) < 0:
        raise ValueError(
            f"`DDPTRAIN_CONSOLE_RANKS` must be 'all' or comma-separated ranks such as '0' or '0,3', got {raw!r}."
        )
    return ranks


def worker_start(use_gpu: bool) -> str:
    """How agents start workers, from ``DDPTRAIN_WORKER_START``: ``"shared"`` loads the training
    function once in the agent and forks (the default on CPU), ``"clean"`` forks first and lets
    each worker load it (the default with GPUs: nothing of the user's touches CUDA before the fork)."""
    raw = os.environ.get("DDPTRAIN_WORKER_START", "").strip() or "auto"
    if raw not in ("auto", "shared", "clean"):
        raise ValueError(f"`DDPTRAIN_WORKER_START` must be 'auto', 'shared' or 'clean', got {raw!r}.")
    if raw == "auto":
        return "clean" if use_gpu else "shared"
    return raw


# `ddptrain run --hosts FILE`: the host file of the script's own trainers. Held by the process,
# never put in the environment, so that the programs the script starts do not get it;
# `ddptrain.ray_compat` hands it to the processes multiprocessing starts from the script.
_script_hostfile: str | None = None


def set_script_hostfile(path: str | None) -> None:
    """Make ``path`` this process's host file (``ddptrain run --hosts``), over ``DDPTRAIN_HOSTFILE``."""
    global _script_hostfile
    _script_hostfile = path


def script_hostfile() -> str | None:
    """The host file ``ddptrain run --hosts`` gave this process (``None``: none)."""
    return _script_hostfile


def run_name() -> str | None:
    """The name of runs whose ``RunConfig`` gives none (``DDPTRAIN_RUN_NAME``; ``ddptrain submit``'s
    batch script sets it to ``<job name>-<job id>``, which a requeued job keeps). ``None``: a fresh
    ``ddptrain_run-<timestamp>``."""
    raw = (os.environ.get("DDPTRAIN_RUN_NAME") or "").strip()
    if "/" in raw or raw in (".", ".."):
        raise ValueError(f"`DDPTRAIN_RUN_NAME` must be a plain folder name without '/', got {raw!r}.")
    return raw or None


def hostfile() -> str | None:
    """The host file of multi-host runs: ``ddptrain run --hosts FILE``'s in the script's processes,
    else ``DDPTRAIN_HOSTFILE`` (``None``: this machine only)."""
    return _script_hostfile or os.environ.get("DDPTRAIN_HOSTFILE") or None


def ssh_known_hosts() -> str:
    """The known_hosts file SSH host keys are checked against."""
    return os.path.expanduser(os.environ.get("DDPTRAIN_SSH_KNOWN_HOSTS") or "~/.ssh/known_hosts")


def ssh_config_path() -> str:
    """The OpenSSH client config used for host lookups."""
    return os.path.expanduser(os.environ.get("DDPTRAIN_SSH_CONFIG") or "~/.ssh/config")


def ssh_accept_new_host_keys() -> bool:
    """Whether hosts missing from known_hosts are accepted (off unless set to 1)."""
    return os.environ.get("DDPTRAIN_SSH_ACCEPT_NEW_HOST_KEYS") == "1"


def ssh_connect_timeout_s() -> float:
    """Seconds to connect and log in to a host."""
    return _float("DDPTRAIN_SSH_CONNECT_TIMEOUT_S", 10.0)


def driver_address() -> str | None:
    """The address remote workers use to reach the driver's store (default: the address the
    driver's SSH connection to each host comes from)."""
    return os.environ.get("DDPTRAIN_DRIVER_ADDRESS") or None


_DEFAULT_FORWARD = (
    "DDPTRAIN_*",
    "NCCL_*",
    "GLOO_*",
    "TORCH_*",
    "OMP_*",
    "MKL_*",
    "PYTHONPATH",
    "HF_*",
    "WANDB_*",
    "MLFLOW_*",
    "ACCELERATE_*",
)


def forwarded_env_patterns() -> tuple[str, ...]:
    """Driver environment variables passed to remote workers: name patterns (fnmatch) from
    ``DDPTRAIN_FORWARD_ENV`` (comma-separated) on top of the defaults."""
    extra = tuple(p.strip() for p in os.environ.get("DDPTRAIN_FORWARD_ENV", "").split(",") if p.strip())
    return _DEFAULT_FORWARD + extra


def forwarded_env() -> dict[str, str]:
    """The driver's environment variables that programs on other hosts get: those whose names
    match :func:`forwarded_env_patterns`."""
    import fnmatch

    patterns = forwarded_env_patterns()
    return {k: v for k, v in os.environ.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}


def ssh_heartbeat_timeout_s() -> float:
    """Seconds of silence after which a remote agent stops its workers (nothing from the
    driver), and after which the driver declares that host lost (nothing from its agent)."""
    value = _float("DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S", 5.0)
    if value < 1.0:  # heartbeats go every half second both ways
        raise ValueError(f"`DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S` must be >= 1 (seconds), got {value:g}.")
    return value
