"""What running trials hold: this machine's CPUs and GPU ids, and the slots of host lists (driver side).

A trial that runs here reserves ``num_workers * resources_per_worker["CPU"]`` CPUs (fractions
allowed) and whole GPU ids, as before. A trainer trial whose workers run on a host list
(``ScalingConfig(hosts=...)`` or ``$DDPTRAIN_HOSTFILE``) reserves slots instead, the unit
:func:`ddptrain.hosts.place_workers` places workers by: one slot is one worker, whatever its
``resources_per_worker``. The slots of a host are shared by every trial of the sweep that
lists it (a host is known by its name and port), so trials running at once never put more
workers on a host than its ``slots``. A trial is placed, with its own ``placement_strategy``,
on the slots the running trials left; it waits if they are too few, and fails at once if its
whole host list has fewer slots than it has workers. It then runs on exactly what it was
given: its ``ScalingConfig.hosts`` becomes those hosts, each with ``slots=`` its workers there.

With ``use_gpu``, GPU ids are shared out too. A host listed with ``gpus=`` (or without
``slots``, whose GPUs are then counted once per sweep: ids ``0..n-1``) lends each GPU trial
whole ids of its own, enough for its workers there at ``gpus_per_worker`` each (trials never
share a GPU, even at a fraction of one per worker). The trial runs with that host's ``gpus=``
set to its ids (its agent sees only them), waits while no placement has enough GPUs free, and
gives them back when it ends. A host with ``slots`` but no ``gpus`` says nothing of which
GPUs it has: its workers use the devices of their local ranks, so a GPU trial holds such a
host whole, as before. GPU trials may share a host with CPU trials either way. The trial's
driver runs here and reserves only the CPUs asked for with ``with_resources(trainer, {"CPU": n})``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from ddptrain import _env
from ddptrain.errors import ConfigError
from ddptrain.launch.hosts import (
    GpuId,
    HostSpec,
    gpus_needed,
    is_local,
    place_workers,
    slots_for_gpus,
    visible_gpu_ids,
    with_ssh_config,
)
from ddptrain.launch.ssh import gpu_count, gpu_slots
from ddptrain.tune.trainable import PreparedTrial

__all__ = ["Grant", "HostPool", "Resources"]

_HostKey = tuple[str, int | None]


def _key(host: HostSpec) -> _HostKey:
    return (host.name, host.port)


def _gpu_pool(total_gpus: int | None) -> list[GpuId]:
    """The GPU ids trials may use: those of the sweep's ``CUDA_VISIBLE_DEVICES`` (indices, or
    ``GPU-...``/``MIG-...`` UUIDs, handed on as written), else every device."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids: list[GpuId]
    if visible is not None:
        ids = visible_gpu_ids(visible)
    elif total_gpus is not None:
        ids = list(range(total_gpus))
    else:
        try:
            import torch

            ids = list(range(torch.cuda.device_count()))
        except Exception:
            ids = []
    return ids if total_gpus is None else ids[:total_gpus]


@dataclass
class Grant:
    """What one running trial holds.

    Attributes:
        cpus: CPUs of this machine.
        gpu_ids: GPU ids of this machine (indices, or UUIDs where the sweep's
            ``CUDA_VISIBLE_DEVICES`` names GPUs so).
        hosts: Its share of a host list, each host with ``slots`` = its workers there and,
            for a GPU trial, ``gpus`` = the GPU ids it holds there (``None``: the trial runs here).
        use_gpu: Its workers on ``hosts`` use GPUs.
    """

    cpus: float = 0.0
    gpu_ids: list[GpuId] = field(default_factory=list)
    hosts: list[HostSpec] | None = None
    use_gpu: bool = False


class HostPool:
    """The slots and GPU ids of every host the sweep's trials list, and what running trials hold.

    Example:
        >>> pool = HostPool()
        >>> hosts = [HostSpec("h0", slots=2), HostSpec("h1", slots=2)]
        >>> [(h.name, h.slots) for h in pool.take(hosts, 2, "PACK", use_gpu=False)]
        [('h0', 2)]
        >>> [(h.name, h.slots) for h in pool.take(hosts, 2, "PACK", use_gpu=False)]
        [('h1', 2)]
        >>> pool.take(hosts, 2, "PACK", use_gpu=False) is None  # waits for a trial to end
        True
        >>> gpu_hosts = [HostSpec("g0", slots=2, gpus=(0, 1))]
        >>> [h.gpus for h in pool.take(gpu_hosts, 1, "PACK", use_gpu=True)]
        [(0,)]
        >>> [h.gpus for h in pool.take(gpu_hosts, 1, "PACK", use_gpu=True)]
        [(1,)]
    """

    def __init__(self) -> None:
        self._used: dict[_HostKey, int] = {}
        self._gpu_holders: set[_HostKey] = set()  # hosts without `gpus` that a GPU trial holds whole
        self._gpus_held: dict[_HostKey, set[GpuId]] = {}  # GPU ids of hosts with `gpus` that trials hold

    @staticmethod
    def total_slots(hosts: list[HostSpec]) -> int:
        """Slots of the whole list (a host without ``slots`` has 1, as ``place_workers`` counts)."""
        return sum(h.slots if h.slots is not None else 1 for h in hosts)

    def free_slots(self, host: HostSpec, use_gpu: bool = False, gpus_per_worker: float = 1.0) -> int:
        """Workers ``host`` can take now: its slots no running trial holds, and for a GPU trial
        no more than its free GPU ids hold (0 if GPU trials hold it whole or in part, when its
        GPU ids are unknown)."""
        slots = host.slots if host.slots is not None else 1
        free = max(0, slots - self._used.get(_key(host), 0))
        if not use_gpu:
            return free
        if _key(host) in self._gpu_holders:
            return 0
        if host.gpus is None:
            return 0 if self._gpus_held.get(_key(host)) else free
        return min(free, slots_for_gpus(len(self.free_gpus(host)), gpus_per_worker))

    def free_gpus(self, host: HostSpec) -> list[GpuId]:
        """The ids of ``host``'s ``gpus`` that no running trial holds."""
        held = self._gpus_held.get(_key(host), set())
        return [gpu for gpu in host.gpus or () if gpu not in held]

    def take(
        self, hosts: list[HostSpec], num_workers: int, strategy: str, use_gpu: bool, gpus_per_worker: float = 1.0
    ) -> list[HostSpec] | None:
        """Place ``num_workers`` on the free slots (and GPUs) of ``hosts``; ``None`` if they are too few now.

        Returns the hosts given, in list order, each with ``slots`` = its workers there and, for
        a GPU trial on a host with ``gpus``, ``gpus`` = the ids it now holds there.
        """
        free = [dataclasses.replace(h, slots=self.free_slots(h, use_gpu, gpus_per_worker)) for h in hosts]
        free = [h for h in free if h.slots]
        if self.total_slots(free) < num_workers:
            return None
        placement = place_workers(free, num_workers, strategy)
        given = []
        for host, ranks in zip(placement.hosts, placement.ranks, strict=True):
            gpus = host.gpus
            if use_gpu and gpus is not None:
                gpus = tuple(self.free_gpus(host)[: gpus_needed(len(ranks), gpus_per_worker)])
            given.append(dataclasses.replace(host, slots=len(ranks), gpus=gpus))
        for host in given:
            self._used[_key(host)] = self._used.get(_key(host), 0) + (host.slots or 0)
            if use_gpu and host.gpus is None:
                self._gpu_holders.add(_key(host))
            elif use_gpu:
                self._gpus_held.setdefault(_key(host), set()).update(host.gpus or ())
        return given

    def give_back(self, given: list[HostSpec], use_gpu: bool) -> None:
        """Return what :meth:`take` gave."""
        for host in given:
            left = self._used.get(_key(host), 0) - (host.slots or 0)
            if left > 0:
                self._used[_key(host)] = left
            else:
                self._used.pop(_key(host), None)
            if use_gpu and host.gpus is None:
                self._gpu_holders.discard(_key(host))
            elif use_gpu:
                held = self._gpus_held.get(_key(host), set()) - set(host.gpus or ())
                if held:
                    self._gpus_held[_key(host)] = held
                else:
                    self._gpus_held.pop(_key(host), None)


class Resources:
    """This machine's CPUs and GPU ids, and the host pool, for one sweep.

    Args:
        total_cpus: CPUs trials may reserve together here.
        total_gpus: GPUs trials may use here (default: every visible GPU, looked up when a
            trial first needs one).
    """

    def __init__(self, total_cpus: float, total_gpus: int | None) -> None:
        self.total_cpus = total_cpus
        self.free_cpus = total_cpus
        self._gpus_total = total_gpus
        self._all_gpus: list[GpuId] | None = None
        self._free_gpus: list[GpuId] = []
        self.hosts = HostPool()
        self._probed: dict[_HostKey, tuple[GpuId, ...]] = {}  # GPU ids of hosts counted for GPU trials

    def _gpu_ids(self) -> list[GpuId]:
        if self._all_gpus is None:
            self._all_gpus = _gpu_pool(self._gpus_total)
            self._free_gpus = list(self._all_gpus)
        return self._all_gpus

    def host_list(self, prepared: PreparedTrial) -> list[HostSpec] | None:
        """The trial's host list with every ``slots`` known (``None``: it runs here).

        With ``use_gpu``, a host with neither ``slots`` nor ``gpus`` is probed for its GPUs once
        per sweep and gets ``gpus`` = their ids, so that trials can share it GPU by GPU.
        """
        if prepared.hosts is None or prepared.trainer is None:
            return None
        scaling = prepared.trainer.scaling_config
        if not scaling.use_gpu:
            return prepared.hosts
        hosts = []
        for host in prepared.hosts:
            if host.slots is None and host.gpus is None:
                if _key(host) not in self._probed:
                    if is_local(host):  # the ids this process sees, as local trials count them
                        ids = _gpu_pool(None)
                    else:
                        ids = list(range(gpu_count(with_ssh_config(host, _env.ssh_config_path()))))
                    self._probed[_key(host)] = tuple(ids)
                if not self._probed[_key(host)]:
                    raise ConfigError(
                        f"host {host.name!r} has no GPU that `use_gpu=True` could use; "
                        "give it `slots=` or `gpus=` in the host list, or remove it."
                    )
                host = dataclasses.replace(host, gpus=self._probed[_key(host)])
            hosts.append(host)
        return gpu_slots(hosts, scaling.num_gpus_per_worker)

    def never_fits(self, trial_id: str, prepared: PreparedTrial) -> Exception | None:
        """Why the trial can never start, even alone (``None``: it can, now or later)."""
        try:
            hosts = self.host_list(prepared)
        except Exception as exc:  # a host without GPUs, or one that cannot be reached to count them
            return exc
        if hosts is not None:
            assert prepared.trainer is not None
            workers = prepared.trainer.scaling_config.max_workers
            total = HostPool.total_slots(hosts)
            if workers > total:
                listing = ", ".join(f"{h.name}={h.slots if h.slots is not None else 1}" for h in hosts)
                return ConfigError(
                    f"Trial {trial_id} needs {workers} worker slots but its host list has {total} ({listing}). "
                    "Add hosts or `slots=`, or lower `num_workers`."
                )
        gpus_needed = math.ceil(prepared.gpus)
        all_gpus = len(self._gpu_ids()) if gpus_needed else 0
        if prepared.cpus > self.total_cpus + 1e-9 or gpus_needed > all_gpus:
            return ConfigError(
                f"Trial {trial_id} needs {prepared.cpus:g} CPU(s) and {prepared.gpus:g} GPU(s) but the sweep has "
                f"{self.total_cpus:g} CPU(s) and {all_gpus} GPU(s). Lower `num_workers` or "
                "`resources_per_worker`, or raise `TuneConfig(total_cpus=...)` to oversubscribe the CPUs."
            )
        return None

    def acquire(self, prepared: PreparedTrial) -> Grant | None:
        """Reserve what the trial needs, or ``None`` if it must wait for running trials to end."""
        gpus_needed = math.ceil(prepared.gpus)
        if gpus_needed:
            self._gpu_ids()
        if prepared.cpus > self.free_cpus + 1e-9 or (gpus_needed and gpus_needed > len(self._free_gpus)):
            return None
        grant = Grant()
        hosts = self.host_list(prepared)
        if hosts is not None:
            assert prepared.trainer is not None
            scaling = prepared.trainer.scaling_config
            given = self.hosts.take(
                hosts, scaling.max_workers, scaling.placement_strategy, scaling.use_gpu, scaling.num_gpus_per_worker
            )
            if given is None:
                return None
            grant.hosts, grant.use_gpu = given, scaling.use_gpu
        if gpus_needed:
            grant.gpu_ids, self._free_gpus = self._free_gpus[:gpus_needed], self._free_gpus[gpus_needed:]
        grant.cpus = prepared.cpus
        self.free_cpus -= prepared.cpus
        return grant

    def release(self, grant: Grant) -> None:
        """Give back what :meth:`acquire` reserved."""
        self.free_cpus += grant.cpus
        self._free_gpus.extend(grant.gpu_ids)
        if grant.hosts is not None:
            self.hosts.give_back(grant.hosts, grant.use_gpu)
