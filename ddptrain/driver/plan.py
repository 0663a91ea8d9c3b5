"""The placement plan of a worker group: which host runs which ranks, with what environment.

A plan is built from the scaling config (and the run's worker env vars) before anything
starts, so a bad host list is an error before any process exists. It starts the agents of one
group (``new_launcher``) and writes each worker's spec and the agents' bootstrap; it knows
nothing of run directories, reports or checkpoints.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import replace
from typing import Any

from ddptrain import _env, ray_compat
from ddptrain.config import ScalingConfig
from ddptrain.driver.gpu_env import set_gpu_defaults
from ddptrain.errors import ConfigError, LaunchError
from ddptrain.launch.fanout import each_host
from ddptrain.launch.hosts import (
    SLURM,
    HostSpec,
    Placement,
    gpus_needed,
    is_local,
    parse_hosts,
    place_workers,
    slots_for_gpus,
    visible_gpu_ids,
    with_ssh_config,
    worker_gpus,
    workers_per_gpu,
)
from ddptrain.launch.launcher import GroupLauncher, HostLauncher, Launcher, LocalLauncher
from ddptrain.launch.slurm import SlurmLauncher
from ddptrain.launch.slurm_allocation import allocation_hosts
from ddptrain.launch.ssh import SSHLauncher, gpu_slots
from ddptrain.wire.protocol import Bootstrap, RunInfo, StoreAddress, WorkerSpec

__all__ = ["Plan"]


class Plan:
    """Where the ranks of a group run.

    Args:
        scaling_config: Number of workers, their resources, and the host list.
        env_vars: Extra environment of every worker (``RunConfig.worker_runtime_env``).
        share_visible_gpus: The workers on a host all see its GPUs (torch); ``False``: each worker sees
            only its own, as ``CUDA_VISIBLE_DEVICES`` (``BackendConfig.shares_visible_gpus``).
    """

    def __init__(
        self,
        scaling_config: ScalingConfig,
        env_vars: dict[str, str] | None = None,
        share_visible_gpus: bool = True,
        left_out: frozenset[str] = frozenset(),
    ) -> None:
        self.scaling_config = scaling_config
        self.env_vars = dict(env_vars or {})
        self.share_visible_gpus = share_visible_gpus
        self.hostname = socket.gethostname()
        self.left_out = left_out  # an elastic run's hosts that were lost: not in this plan
        self.world_size = scaling_config.max_workers  # an elastic run's: what the capacity allows
        self.placement = self._placement()

    @staticmethod
    def read_hosts(scaling_config: ScalingConfig) -> list[HostSpec] | None:
        """The run's host list (``ScalingConfig.hosts`` or ``$DDPTRAIN_HOSTFILE``, with
        ``~/.ssh/config`` applied), or ``None`` for this machine alone. Reaches no host.

        Raises:
            ConfigError: The host list is malformed, or cannot hold the workers (counted from
                ``slots`` where no GPU probe is needed).
        """
        raw = scaling_config.hosts if scaling_config.hosts is not None else _env.hostfile()
        if raw is None:
            return None
        if raw == SLURM:
            gpus = scaling_config.num_gpus_per_worker
            hosts = allocation_hosts(use_gpu=scaling_config.use_gpu, gpus_per_worker=gpus or 1.0)
        else:
            hosts = [h if is_local(h) else with_ssh_config(h, _env.ssh_config_path()) for h in parse_hosts(raw)]
        if not scaling_config.use_gpu:  # placing needs no host's GPU count: check it now
            place_workers(hosts, scaling_config.min_workers, scaling_config.placement_strategy)
        return hosts

    def _placement(self) -> Placement | None:
        config = self.scaling_config
        hosts = self.read_hosts(config)
        if hosts is None:
            if config.elastic:
                self.world_size = self._elastic_size(self._local_capacity(), "this machine")
            return None
        if config.elastic:
            hosts = [h for h in hosts if h.name not in self.left_out]
        if config.use_gpu:  # a host without `slots` runs one worker per GPU
            hosts = self._gpu_slots(hosts)
        if config.elastic:
            capacity = sum(h.slots if h.slots is not None else 1 for h in hosts)
            where = "the hosts" + (
                f" not left out ({', '.join(sorted(self.left_out))} stopped answering)" if self.left_out else ""
            )
            self.world_size = self._elastic_size(capacity, where)
        return place_workers(hosts, self.world_size, config.placement_strategy)

    def _run_visible(self) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` of the run's env vars: what the workers see where no host
        list's ``gpus=`` says otherwise (``None``: not set there)."""
        return self.env_vars.get("CUDA_VISIBLE_DEVICES")

    def _with_run_gpus(self, hosts: list[HostSpec]) -> list[HostSpec]:
        """Hosts without ``gpus=`` get those of the run's ``CUDA_VISIBLE_DEVICES``, if set: its
        workers see them, so they are counted, not the host's GPUs (``nvidia-smi -L`` lists all)."""
        visible = self._run_visible()
        if visible is None:
            return hosts
        ids = tuple(visible_gpu_ids(visible))
        return [host if host.gpus is not None else replace(host, gpus=ids) for host in hosts]

    def _gpu_slots(self, hosts: list[HostSpec]) -> list[HostSpec]:
        """``gpu_slots`` of the hosts as the run's workers see them (:meth:`_with_run_gpus`)."""
        try:
            return gpu_slots(self._with_run_gpus(hosts), self.scaling_config.num_gpus_per_worker)
        except ConfigError as exc:
            visible = self._run_visible()
            if visible is None:
                raise
            raise ConfigError(
                f"{exc} (Hosts without `gpus=` have those of CUDA_VISIBLE_DEVICES={visible!r} in the run's env vars.)"
            ) from None

    def _local_gpu_count(self) -> tuple[int, str]:
        """GPUs the workers of a local run see, and who says so: the run's ``CUDA_VISIBLE_DEVICES``
        if set, else torch's count here (NVML's: it does not start CUDA)."""
        visible = self._run_visible()
        if visible is not None:
            return len(visible_gpu_ids(visible)), f"CUDA_VISIBLE_DEVICES={visible!r} of the run's env vars lists"
        import torch

        return torch.cuda.device_count(), "torch sees"

    def _local_capacity(self) -> int:
        """How many workers this machine holds: its GPUs (by ``num_gpus_per_worker``), or its
        CPUs (by ``num_cpus_per_worker``)."""
        config = self.scaling_config
        if config.use_gpu:
            return slots_for_gpus(self._local_gpu_count()[0], config.num_gpus_per_worker)
        return int((os.cpu_count() or 1) // max(config.num_cpus_per_worker, 1))

    def _elastic_size(self, capacity: int, where: str) -> int:
        """An elastic run's world size: ``capacity`` up to ``max_workers``, at least ``min_workers``.

        Raises:
            LaunchError: The capacity is below ``min_workers``.
        """
        low, high = self.scaling_config.min_workers, self.scaling_config.max_workers
        if capacity < low:
            raise LaunchError(
                f"`num_workers=({low}, {high})` needs at least {low} workers, but {where} hold {capacity}. "
                "Bring hosts back (or add some), or lower min_workers."
            )
        return min(capacity, high)

    def check_gpus(self) -> None:
        """A local GPU group needs that many GPUs here (each host of a host list was checked
        against its own GPUs when the plan was made)."""
        if not self.scaling_config.use_gpu or self.placement is not None:
            return
        gpus = self.scaling_config.num_gpus_per_worker
        needed = gpus_needed(self.world_size, gpus)
        available, who = self._local_gpu_count()
        if needed > available:
            shares = f", {workers_per_gpu(gpus)} per GPU" if gpus < 1 else ""
            raise ConfigError(
                f"`ScalingConfig` asks for {needed} GPU(s) on this machine "
                f"({self.world_size} workers at {gpus:g} GPU(s) each{shares}), "
                f"but {who} {available}. Lower `num_workers` or set `use_gpu=False`."
            )

    @property
    def nodes(self) -> list[list[int]]:
        """The ranks of each host, in node-rank order (one host: this machine)."""
        return self.placement.ranks if self.placement else [list(range(self.world_size))]

    def local_devices(self, local_rank: int) -> tuple[int, ...]:
        """The GPU numbers of a host's ``local_rank``-th worker among the GPUs the host lets the
        run see (``()`` without GPUs). Fractional GPUs put several workers on one number, and
        fill one GPU before the next (a worker's share never spans two GPUs, as in Ray)."""
        return worker_gpus(local_rank, self.scaling_config.num_gpus_per_worker)

    @property
    def ranks_share_a_gpu(self) -> bool:
        """Whether two workers of a host are given the same GPU (fractional GPUs per worker)."""
        for ranks in self.nodes:
            numbers = [n for local_rank in range(len(ranks)) for n in self.local_devices(local_rank)]
            if len(set(numbers)) < len(numbers):
                return True
        return False

    def reuse_key(self) -> tuple[Any, ...]:
        """Two plans with equal keys start identical groups: a warm group of one can serve the other."""
        env = sorted(self.agent_env().items())
        return (
            repr(self.scaling_config),
            self.world_size,
            self.share_visible_gpus,
            env,
            tuple(sys.path),
            os.getcwd(),
            ray_compat.installed(),
        )

    def agents_key(self) -> tuple[Any, ...]:
        """Two plans with equal keys run on the same agents: the same hosts in the same order,
        with the same environment (a restart from warm agents keeps the last attempt's)."""
        hosts = None if self.placement is None else [repr(host) for host in self.placement.hosts]
        return (hosts, sorted(self.agent_env().items()), self.share_visible_gpus, tuple(sys.path), os.getcwd())

    # ----------------------------------------------------------------- starting agents
    def agent_env(self, remote: bool = False, host: HostSpec | None = None) -> dict[str, str]:
        """Environment of an agent and its workers: the driver's own for a local agent; for a
        remote one only the variables meant for workers (the driver's PATH or HOME may not
        exist there).

        A GPU group's agent on a ``host`` with ``gpus=`` sees only those GPUs: its workers'
        devices (indices by local rank) then number them from 0. This overrides a
        ``CUDA_VISIBLE_DEVICES`` of the run's env vars on that host, since the host list is what
        says which GPUs of that host the run may use (a sweep hands each trial its own ones).
        GPU workers number GPUs in PCI bus order, as those ids do, and workers sharing a GPU
        keep JAX and TensorFlow to their share of its memory (``gpu_env``), unless the run's
        env vars (or, for a local agent, the driver's environment) say otherwise.
        """
        env = _env.forwarded_env() if remote else dict(os.environ)
        env.update(self.env_vars)
        env.setdefault("OMP_NUM_THREADS", str(self.scaling_config._omp_num_threads()))
        if not self.scaling_config.use_gpu:
            # accelerate (and the HF Trainer on it) joins CPU workers into one group only with
            # this set; otherwise each process trains alone. The user's own value wins.
            env.setdefault("ACCELERATE_USE_CPU", "1")
        env[_env.WORKER_MARKER] = "1"
        if self.scaling_config.use_gpu:
            env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            set_gpu_defaults(env, self.scaling_config.num_gpus_per_worker)
            if host is not None and host.gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in host.gpus)
        return env

    def host_key(self, host: HostSpec) -> tuple[Any, ...]:
        """Two plans with equal keys for a host run its workers on the same agent."""
        env = tuple(sorted(self.agent_env(remote=True, host=host).items()))
        return (repr(host), env, tuple(sys.path), os.getcwd())

    def new_launcher(self, kept: dict[Any, tuple[HostLauncher, str]] | None = None) -> Launcher:
        """Start the agents of one group: one local process, or one per host over SSH, or one
        per node of the SLURM allocation with ``srun``. ``kept``: agents of an earlier group,
        reset, by :meth:`host_key`: their hosts get no new one (those of other hosts are
        shut down)."""
        if self.placement is None:
            return LocalLauncher(self.agent_env())
        kept = dict(kept or {})
        keys = [self.host_key(host) for host in self.placement.hosts]

        def start(host: HostSpec) -> tuple[HostLauncher, str]:
            warm = kept.pop(self.host_key(host), None)
            if warm is not None:
                return warm
            if host.srun:
                node = SlurmLauncher(host.name, self.agent_env(remote=True, host=host), sys.executable, os.getcwd())
                return node, node.local_address
            if is_local(host):
                return LocalLauncher(self.agent_env(host=host)), "127.0.0.1"
            python = host.python or sys.executable
            launcher = SSHLauncher(host, self.agent_env(remote=True, host=host), python, host.workdir or os.getcwd())
            return launcher, _env.driver_address() or launcher.local_address

        results = each_host(start, self.placement.hosts, name="ddptrain-start")
        for launcher, _ in kept.values():  # hosts of the earlier group that this one has not
            launcher.shutdown(0)
        errors = [r for r in results if isinstance(r, BaseException)]
        started = [r for r in results if not isinstance(r, BaseException)]
        if errors:
            for launcher, _ in started:
                launcher.shutdown(0)
            failed = [
                host.name for host, r in zip(self.placement.hosts, results, strict=True) if isinstance(r, BaseException)
            ]
            raise LaunchError("\n".join(str(e) for e in errors), hosts=failed) from errors[0]
        try:
            return GroupLauncher(started, keys)
        except BaseException:
            for launcher, _ in started:
                launcher.shutdown(0)
            raise

    # ----------------------------------------------------------------- ranks and hosts
    def bootstrap(
        self,
        payload: bytes | None,
        run: RunInfo,
        store: StoreAddress,
        datasets: dict[int, Any] | None,
    ) -> Bootstrap:
        """What the agents need to start this plan's workers for ``run`` (all hosts' workers;
        each host's launcher sends its own share)."""
        return Bootstrap(
            payload=payload,
            sys_path=tuple(sys.path),
            cwd=os.getcwd(),
            start=_env.worker_start(self.scaling_config.use_gpu),
            grace_s=_env.shutdown_grace_s(),
            workers=self.worker_specs(run.attempt, store.host, store.port, datasets),
            run=run,
            store=store,
            ray_compat=ray_compat.installed(),
        )

    def worker_specs(
        self, attempt: int, store_host: str, store_port: int, datasets: dict[int, Any] | None = None
    ) -> tuple[WorkerSpec, ...]:
        """Each worker's rank, devices, torchrun-style environment and dataset shards
        (``attempt``: the run's attempt number, torchrun's ``TORCHELASTIC_RESTART_COUNT``)."""
        world = self.world_size
        nodes = self.nodes
        specs = []
        for node_rank, ranks in enumerate(nodes):
            for local_rank, rank in enumerate(ranks):
                devices = self.local_devices(local_rank)
                env = {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(local_rank),
                    "LOCAL_WORLD_SIZE": str(len(ranks)),
                    "NODE_RANK": str(node_rank),
                    "GROUP_RANK": str(node_rank),
                    "GROUP_WORLD_SIZE": str(len(nodes)),
                    "ROLE_RANK": str(rank),
                    "ROLE_WORLD_SIZE": str(world),
                    "MASTER_ADDR": store_host,
                    "MASTER_PORT": str(store_port),
                    # torch's env:// and tcp:// rendezvous then join the driver's store as clients.
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "TORCHELASTIC_RESTART_COUNT": str(attempt),
                }
                if devices and not self.share_visible_gpus:  # the worker narrows CUDA_VISIBLE_DEVICES to these
                    env[_env.OWN_GPUS] = ",".join(str(device) for device in devices)
                    devices = tuple(range(len(devices)))
                specs.append(
                    WorkerSpec(
                        rank=rank,
                        local_rank=local_rank,
                        node_rank=node_rank,
                        world_size=world,
                        local_world_size=len(ranks),
                        devices=devices,
                        env=env,
                        datasets=datasets[rank] if datasets is not None else {},
                    )
                )
        return tuple(specs)

    def remote_ranks(self) -> list[int]:
        """Ranks that run on other hosts than the driver's (over SSH)."""
        if self.placement is None:
            return []
        return [
            rank
            for host, ranks in zip(self.placement.hosts, self.placement.ranks, strict=True)
            if not is_local(host)
            for rank in ranks
        ]

    def ranks_of_agent(self, first_rank: int | None) -> list[int]:
        """The ranks run by the agent whose first rank is ``first_rank`` (``None``: the only agent)."""
        if self.placement is None or first_rank is None:
            return list(range(self.world_size))
        node, _ = self.placement.node_of(first_rank)
        return self.placement.ranks[node]

    def host_of(self, rank: int) -> str:
        """The name of the host that runs ``rank``."""
        if self.placement is None:
            return self.hostname
        return self.placement.hosts[self.placement.node_of(rank)[0]].name

    def rank_labels(self) -> dict[int, str]:
        if self.placement is None:
            return {rank: f"rank{rank}" for rank in range(self.world_size)}
        return {
            rank: f"{host.name}:rank{rank}"
            for host, ranks in zip(self.placement.hosts, self.placement.ranks, strict=True)
            for rank in ranks
        }
