"""``ScalingConfig``: how many workers a run has and what each gets (driver side; imported
from :mod:`ddptrain.config` and ``ddptrain``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from ddptrain._checks import DEPRECATED, check_int, refuse_deprecated
from ddptrain.errors import ConfigError
from ddptrain.launch.hosts import SLURM, parse_hosts

__all__ = ["ScalingConfig"]

_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class ScalingConfig:
    """How many workers to run, and on what.

    Args:
        num_workers: Number of worker processes. ``0`` runs the training function in the
            driver process (Ray's local mode). ``(min_workers, max_workers)``: an elastic run
            (as Ray's): each attempt starts with as many workers as the capacity allows (this
            machine's CPUs or GPUs; the slots of the hosts not left out), up to
            ``max_workers``, and needs ``min_workers``. A host lost during an attempt is left
            out of the next one, which resumes from the latest checkpoint with fewer workers.
        elastic_resize_monitor_interval_s: An elastic run's interval (seconds) between
            looks at whether hosts left out answer again.
        use_gpu: Give each worker its own CUDA device and use the NCCL backend.
        resources_per_worker: ``{"GPU": k}`` gives each worker ``k`` devices (``get_devices()``);
            ``{"CPU": n}`` sets ``OMP_NUM_THREADS=n`` in each worker unless you set it yourself.
            Other keys (Ray's custom resources, ``memory``) are accepted and ignored; a
            misspelt ``"CPU"`` or ``"GPU"`` (``"gpu"``, ``"GPUS"``) is an error.
        placement_strategy: ``"PACK"`` fills hosts in order, ``"SPREAD"`` round-robins
            (matters for multi-host runs).
        accelerator_type: Accepted for compatibility; ddptrain does not select GPUs by type.
        hosts: ddptrain's own: a host file path, or a list of ``"name slots=N ..."`` strings or
            :class:`~ddptrain.hosts.HostSpec`, to run the workers on those hosts over SSH.
            Default: the host file of ``ddptrain run --hosts FILE`` in the script it runs, else
            ``$DDPTRAIN_HOSTFILE`` if set, else this machine only. See ``ddptrain.hosts``.
            ``"slurm"``: the nodes of the SLURM allocation the script runs in, each node's agent
            started with ``srun`` (see docs/slurm.md); never chosen automatically.

    Example:
        >>> ScalingConfig(num_workers=2, use_gpu=False)
        ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker=None, ...)
    """

    num_workers: int | tuple[int, int] = 1
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None
    placement_strategy: str = "PACK"
    accelerator_type: str | None = None
    label_selector: dict[str, str] | list[dict[str, str]] | None = None
    use_tpu: bool = False
    topology: str | None = None
    elastic_resize_monitor_interval_s: float = 60.0
    trainer_resources: Any = DEPRECATED
    hosts: str | os.PathLike[str] | list[Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, (tuple, list)):
            if len(self.num_workers) != 2:
                raise ConfigError(
                    f"`num_workers` as a range must be (min_workers, max_workers), got {self.num_workers!r}."
                )
            low, high = self.num_workers
            check_int("num_workers[0] (min_workers)", low, 1)
            check_int("num_workers[1] (max_workers)", high, 1)
            if low > high:
                raise ConfigError(
                    "`num_workers=(min_workers, max_workers)` needs min_workers <= max_workers, "
                    f"got {self.num_workers!r}."
                )
            self.num_workers = (low, high)
        else:
            check_int("num_workers", self.num_workers, 0)
        interval = self.elastic_resize_monitor_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise ConfigError(f"`elastic_resize_monitor_interval_s` must be a number of seconds > 0, got {interval!r}.")
        if not isinstance(self.use_gpu, bool):
            raise ConfigError(f"`use_gpu` must be True or False, got {self.use_gpu!r}.")
        if self.use_tpu:
            raise ConfigError("`use_tpu=True` is not supported by ddptrain: it runs on CPUs and CUDA GPUs.")
        refuse_deprecated("ScalingConfig", "trainer_resources", self.trainer_resources, "Remove it.")
        if self.placement_strategy not in _PLACEMENT_STRATEGIES:
            raise ConfigError(
                f"`placement_strategy` must be one of {', '.join(_PLACEMENT_STRATEGIES)}, "
                f"got {self.placement_strategy!r}."
            )
        if self.hosts is not None and self.hosts != SLURM:  # the allocation is read at fit()
            parse_hosts(self.hosts)  # a bad host file is an error now, not at fit()
        resources = self.resources_per_worker
        if resources is not None:
            if not isinstance(resources, dict):
                raise ConfigError(f"`resources_per_worker` must be a dict, got {resources!r}.")
            for key, amount in resources.items():
                if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
                    raise ConfigError(f"`resources_per_worker[{key!r}]` must be a number >= 0, got {amount!r}.")
                meant = str(key).upper().rstrip("S")
                if meant in ("CPU", "GPU") and key != meant:  # other keys (Ray's custom resources) are ignored
                    raise ConfigError(
                        f"`resources_per_worker` has {key!r}: did you mean {meant!r}? The keys ddptrain reads are "
                        "'CPU' and 'GPU', spelled as in Ray."
                    )
            gpus = resources.get("GPU", 0)
            if gpus and not self.use_gpu:
                raise ConfigError(
                    f"`resources_per_worker` asks for {gpus} GPU(s) per worker but `use_gpu` is False. "
                    "Set `use_gpu=True`."
                )
            if self.use_gpu and "GPU" in resources and gpus == 0:
                raise ConfigError(
                    "`use_gpu=True` but `resources_per_worker['GPU']` is 0. "
                    "Give each worker at least part of a GPU, or set `use_gpu=False`."
                )
            if gpus > 1 and not float(gpus).is_integer():
                raise ConfigError(f"`resources_per_worker['GPU']` above 1 must be a whole number, got {gpus}.")

    @property
    def elastic(self) -> bool:
        """Whether ``num_workers`` is a ``(min_workers, max_workers)`` range."""
        return isinstance(self.num_workers, tuple)

    @property
    def min_workers(self) -> int:
        """The fewest workers an attempt may run with (``num_workers`` when it is fixed)."""
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        """The most workers an attempt runs with (``num_workers`` when it is fixed)."""
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def num_gpus_per_worker(self) -> float:
        """GPUs each worker gets: 1 with ``use_gpu`` unless ``resources_per_worker`` says otherwise."""
        if not self.use_gpu:
            return 0
        return float((self.resources_per_worker or {}).get("GPU", 1))

    @property
    def num_cpus_per_worker(self) -> float:
        """CPUs each worker asks for (``resources_per_worker['CPU']``; 1 on CPU, 0 on GPU by default)."""
        default = 0 if self.use_gpu else 1
        return float((self.resources_per_worker or {}).get("CPU", default))

    @property
    def _resources_per_worker_not_none(self) -> dict[str, float]:
        """Each worker's resources as Ray counts them: ``{"CPU": 1}`` (``{"GPU": 1}`` with
        ``use_gpu``) by default, zero entries dropped, and ``accelerator_type:<X>`` at 0.001."""
        if self.resources_per_worker is None:
            resources: dict[str, float] = {"GPU": 1} if self.use_gpu else {"CPU": 1}
        else:
            resources = {k: v for k, v in self.resources_per_worker.items() if v != 0}
        if self.use_gpu:
            resources.setdefault("GPU", 1)
        if self.accelerator_type:
            resources.setdefault(f"accelerator_type:{self.accelerator_type}", 0.001)
        return resources

    @property
    def total_resources(self) -> dict[str, float]:
        """Resources of the whole group, as Ray reports them: each worker's non-zero resources
        times ``num_workers`` (``ScalingConfig(num_workers=2).total_resources == {"CPU": 2.0}``);
        an elastic run's upper bound, from ``max_workers``."""
        return {k: float(v * self.max_workers) for k, v in self._resources_per_worker_not_none.items()}

    def _omp_num_threads(self) -> int:
        cpus = (self.resources_per_worker or {}).get("CPU")
        return max(1, math.floor(cpus)) if cpus else 1
