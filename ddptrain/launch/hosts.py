"""Host lists for multi-host runs: parsing, ``~/.ssh/config`` lookups, and worker placement.

A host file has one host per line, DeepSpeed's ``host slots=N`` plus ddptrain's own options::

    # name          options
    gpu-box-1       slots=4
    gpu-box-2       slots=4 user=alice port=2222 python=/opt/venv/bin/python workdir=/srv/train
    gpu-box-3       gpus=0,1,3
    localhost       slots=2

Blank lines and ``#`` comments are ignored; ``alice@gpu-box-2`` is ``gpu-box-2 user=alice``.
``slots`` is how many workers the host runs (default: its GPU count with ``use_gpu``, else 1).
``gpus`` are the GPU ids (as ``nvidia-smi`` numbers them, or their ``GPU-...``/``MIG-...``
UUIDs) its workers may use with ``use_gpu``: the host's agent runs with
``CUDA_VISIBLE_DEVICES`` set to them, and without ``slots`` the host runs one worker per
``gpus_per_worker`` of them. The driver's own machine may be listed as ``localhost`` (or its
host name); it is then run without SSH.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import shlex
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ddptrain.errors import ConfigError

__all__ = [
    "SLURM",
    "GpuId",
    "HostSpec",
    "Placement",
    "gpus_needed",
    "is_local",
    "parse_hostfile",
    "parse_hosts",
    "place_workers",
    "slots_for_gpus",
    "visible_gpu_ids",
    "worker_gpus",
    "workers_per_gpu",
]

# `hosts="slurm"`: the nodes of the SLURM allocation this process runs in (``ddptrain.launch.slurm``).
SLURM = "slurm"

_OPTIONS = ("slots", "user", "port", "python", "workdir", "key", "gpus")

# A GPU id as CUDA_VISIBLE_DEVICES takes it: an index (as nvidia-smi numbers the GPUs), or an
# opaque UUID string (`GPU-3f2a...`, a MIG device's `MIG-...`), kept as written.
GpuId = int | str
_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/-]*")


@dataclass(frozen=True)
class HostSpec:
    """One host of a multi-host run.

    Attributes:
        name: Host name or address, as written in the host list (also the ``~/.ssh/config`` alias).
        slots: Workers to run there; ``None`` until known (GPU count or 1).
        user: SSH user (default: ``~/.ssh/config`` or the current user).
        port: SSH port (default: ``~/.ssh/config`` or 22).
        python: Python executable on the host (default: the driver's ``sys.executable``).
        workdir: Working directory of the workers (default: the driver's working directory).
        key: Private key file (default: ``~/.ssh/config``, then the SSH agent and ``~/.ssh/id_*``).
        address: Where to connect, after ``~/.ssh/config`` (``HostName``).
        gpus: GPU ids the workers may use with ``use_gpu`` (host file: ``gpus=0,1,3``), as the
            host numbers them, or their UUIDs (``GPU-...``, ``MIG-...``, as ``nvidia-smi -L``
            prints them); ``None``: every GPU of the host. Their agent gets
            ``CUDA_VISIBLE_DEVICES`` set to these ids, overriding ``RunConfig`` env vars there.
        srun: A node of the SLURM allocation this process runs in (``hosts="slurm"``): its agent
            is started as a job step with ``srun``, not over SSH (``ddptrain.launch.slurm``).
    """

    name: str
    slots: int | None = None
    user: str | None = None
    port: int | None = None
    python: str | None = None
    workdir: str | None = None
    key: str | None = None
    address: str | None = None
    gpus: tuple[GpuId, ...] | None = None
    srun: bool = False

    def __post_init__(self) -> None:
        if self.gpus is None:
            return
        problem = _gpus_problem(self.gpus)
        if problem:
            raise ConfigError(f"host {self.name!r}: {problem}, got {self.gpus!r}.")
        object.__setattr__(self, "gpus", tuple(self.gpus))  # a list given in Python stays hashable


def _is_gpu_id(gpu: Any) -> bool:
    return (type(gpu) is int and gpu >= 0) or (isinstance(gpu, str) and _UUID.fullmatch(gpu) is not None)


def _gpus_problem(gpus: Any) -> str | None:
    """What is wrong with a ``gpus`` value (``None``: nothing)."""
    if not isinstance(gpus, (tuple, list)) or not all(_is_gpu_id(g) for g in gpus):
        return (
            "`gpus` must be GPU ids: whole numbers >= 0 or UUIDs as `nvidia-smi -L` prints them "
            "(in a host file: `gpus=0,1,3` or `gpus=GPU-3f2a...,MIG-77b1...`)"
        )
    if len(set(gpus)) != len(gpus):
        return "`gpus` lists a GPU id more than once"
    return None


def _gpu_id(entry: str) -> GpuId | None:
    """One entry of a GPU list as an id: an index as an int, a UUID as written (``None``: neither)."""
    entry = entry.strip()
    if re.fullmatch("[0-9]+", entry):
        return int(entry)
    return entry if _UUID.fullmatch(entry) else None


def _parse_gpus(value: str, where: str) -> tuple[GpuId, ...]:
    ids = [_gpu_id(part) for part in value.split(",")]
    problem = _gpus_problem(ids)  # an entry that is no id (None) is one
    if problem:
        raise ConfigError(f"{where}: {problem}, got {value!r}.")
    return tuple(gpu for gpu in ids if gpu is not None)


def visible_gpu_ids(visible: str) -> list[GpuId]:
    """The GPU ids a ``CUDA_VISIBLE_DEVICES`` value lets a process see, in its order: indices as
    ints, UUIDs (``GPU-...``, ``MIG-...``) as opaque strings. As CUDA does, the list ends at the
    first entry that is neither (``"0,2,-1,1"`` shows 0 and 2); ``""`` shows none."""
    ids: list[GpuId] = []
    for entry in visible.split(",") if visible.strip() else []:
        gpu = _gpu_id(entry)
        if gpu is None:
            break
        ids.append(gpu)
    return ids


def workers_per_gpu(gpus_per_worker: float) -> int:
    """How many workers share one GPU at ``gpus_per_worker`` (below 1) each: as in Ray, a
    worker's share lies on one GPU, so at 0.4 a GPU holds 2 (0.8), never 2.5."""
    return max(1, math.floor(1 / gpus_per_worker + 1e-9))


def slots_for_gpus(count: int, gpus_per_worker: float) -> int:
    """Workers that ``count`` GPUs hold at ``gpus_per_worker`` each (below 1, workers share a GPU)."""
    if gpus_per_worker >= 1:
        return math.floor(count / gpus_per_worker + 1e-9)
    return count * workers_per_gpu(gpus_per_worker)


def gpus_needed(workers: int, gpus_per_worker: float) -> int:
    """GPU ids that ``workers`` workers of one host need (the inverse of :func:`slots_for_gpus`)."""
    if gpus_per_worker >= 1:
        return math.ceil(workers * gpus_per_worker - 1e-9)
    return math.ceil(workers / workers_per_gpu(gpus_per_worker))


def worker_gpus(local_rank: int, gpus_per_worker: float) -> tuple[int, ...]:
    """The GPU numbers of a host's ``local_rank``-th worker, among the GPUs the host lets the run
    see (``()`` without GPUs): whole GPUs in turn, or a share of one (:func:`workers_per_gpu`)."""
    if gpus_per_worker >= 1:
        whole = round(gpus_per_worker)
        return tuple(local_rank * whole + i for i in range(whole))
    if gpus_per_worker > 0:
        return (local_rank // workers_per_gpu(gpus_per_worker),)
    return ()


def _parse_line(text: str, where: str) -> HostSpec:
    try:
        parts = shlex.split(text, comments=True)
    except ValueError as exc:
        raise ConfigError(f"{where}: cannot parse {text!r}: {exc}.") from None
    name, options = parts[0], parts[1:]
    values: dict[str, Any] = {}
    user, at, host = name.rpartition("@")
    if at:  # `alice@gpu-box-2`, as ssh takes it
        if not user or not host:
            raise ConfigError(f"{where}: {name!r} is not a host name (`user@host` needs both).")
        name, values["user"] = host, user
    name = _checked_name(name, where)
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not value:
            raise ConfigError(f"{where}: expected `option=value` after the host name, got {option!r}.")
        if key not in _OPTIONS:
            raise ConfigError(f"{where}: unknown option {key!r}; known options: {', '.join(_OPTIONS)}.")
        if key == "user" and at:
            raise ConfigError(f"{where}: the user is given twice ({user}@ and user={value}); give it once.")
        if key in ("slots", "port"):
            try:
                number = int(value)
            except ValueError:
                raise ConfigError(f"{where}: `{key}` must be a whole number, got {value!r}.") from None
            low = 1 if key == "port" else 0
            if number < low or (key == "port" and number > 65535):
                raise ConfigError(f"{where}: `{key}` out of range, got {number}.")
            values[key] = number
        elif key == "gpus":
            values[key] = _parse_gpus(value, where)
        else:
            values[key] = os.path.expanduser(value) if key in ("key",) else value
    return HostSpec(name=name, **values)


def _checked_name(name: str, where: str) -> str:
    """``name``, an IPv6 address without its brackets; refuses the ``host:N`` of other
    launchers' host lists (ssh would take it for a host name)."""
    if ":" not in name:
        return name
    try:
        return str(ipaddress.IPv6Address(name.removeprefix("[").removesuffix("]")))
    except ValueError:
        pass
    host, _, number = name.rpartition(":")
    hint = f"for workers write `{host} slots={number}`, for an SSH port `{host} port={number}`"
    if not number.isdigit():
        hint = "an SSH port is `port=N`"
    raise ConfigError(f"{where}: {name!r} is not a host name ({hint}).")


def parse_hostfile(path: str | os.PathLike[str]) -> list[HostSpec]:
    """Read a host file (see the module docstring).

    Raises:
        ConfigError: The file is missing, empty, or a line is malformed; the message names the line.
    """
    file = Path(os.path.expanduser(os.fspath(path)))
    try:
        lines = file.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"Cannot read the host file {file}: {exc.strerror}.") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        if line.split("#", 1)[0].strip():
            hosts.append(_parse_line(line, f"{file}:{number}"))
    return _check_unique(hosts, str(file))


def parse_hosts(hosts: str | os.PathLike[str] | list[str | HostSpec]) -> list[HostSpec]:
    """Hosts from a host file path, or a list of ``"name slots=N ..."`` strings / HostSpecs."""
    if isinstance(hosts, (str, os.PathLike)):
        return parse_hostfile(hosts)
    if not isinstance(hosts, (list, tuple)) or not hosts:
        raise ConfigError(f"`hosts` must be a host file path or a non-empty list of hosts, got {hosts!r}.")
    specs = []
    for i, host in enumerate(hosts):
        if isinstance(host, HostSpec):
            specs.append(host)
        elif isinstance(host, str) and host.split("#", 1)[0].strip():
            specs.append(_parse_line(host, f"hosts[{i}]"))
        elif isinstance(host, str) and host.strip():
            continue  # a comment, as in a host file
        else:
            raise ConfigError(f"`hosts[{i}]` must be a host name string or a HostSpec, got {host!r}.")
    return _check_unique(specs, "hosts")


def _check_unique(hosts: list[HostSpec], where: str) -> list[HostSpec]:
    if not hosts:
        raise ConfigError(f"{where}: no hosts listed.")
    seen: set[tuple[str, int | None]] = set()
    for host in hosts:
        key = (host.name, host.port)
        if key in seen:
            raise ConfigError(f"{where}: host {host.name!r} is listed twice; give it more `slots` instead.")
        seen.add(key)
    return hosts


def with_ssh_config(host: HostSpec, config_path: str | None = None) -> HostSpec:
    """Fill user, port, address and key from ``~/.ssh/config`` (values in the host list win)."""
    import paramiko

    path = Path(os.path.expanduser(config_path or "~/.ssh/config"))
    found: dict[str, Any] = {}
    if path.exists():
        config = paramiko.SSHConfig.from_path(str(path))
        found = dict(config.lookup(host.name))
    identity = found.get("identityfile")
    return replace(
        host,
        user=host.user or found.get("user"),
        port=host.port or (int(found["port"]) if "port" in found else None),
        address=host.address or found.get("hostname") or host.name,
        key=host.key or (os.path.expanduser(identity[0]) if identity else None),
    )


def is_local(host: HostSpec) -> bool:
    """Whether ``host`` is this machine, to be run without SSH (a SLURM node never is: its
    agent runs as a job step even on the batch host)."""
    return (
        not host.srun and host.port is None and host.user is None and host.name in ("localhost", socket.gethostname())
    )


@dataclass(frozen=True)
class Placement:
    """Where each rank runs: ``hosts[node_rank]`` holds ``ranks[node_rank]`` (global ranks)."""

    hosts: list[HostSpec]
    ranks: list[list[int]]

    def node_of(self, rank: int) -> tuple[int, int]:
        """(node rank, local rank) of a global rank."""
        for node, ranks in enumerate(self.ranks):
            if rank in ranks:
                return node, ranks.index(rank)
        raise KeyError(rank)


def place_workers(hosts: list[HostSpec], num_workers: int, strategy: str = "PACK") -> Placement:
    """Assign ``num_workers`` ranks to host slots.

    ``PACK`` fills each host in list order before the next; ``SPREAD`` deals ranks round-robin.
    Ranks are contiguous per host in both cases (rank order follows host order), so a host's
    local ranks are ``0..n-1`` and node ranks follow the host list. Hosts that get no worker are
    left out.

    Raises:
        ConfigError: The hosts have fewer slots than ``num_workers``.
    """
    slots = [h.slots if h.slots is not None else 1 for h in hosts]
    total = sum(slots)
    if total < num_workers:
        listing = ", ".join(f"{h.name}={s}" for h, s in zip(hosts, slots, strict=True))
        raise ConfigError(
            f"`num_workers={num_workers}` needs {num_workers} slots, but the hosts have {total} ({listing}). "
            "Add hosts or `slots=`, or lower `num_workers`."
        )
    counts = [0] * len(hosts)
    if strategy in ("SPREAD", "STRICT_SPREAD"):
        left = num_workers
        while left:
            for i in range(len(hosts)):
                if left and counts[i] < slots[i]:
                    counts[i] += 1
                    left -= 1
    else:
        left = num_workers
        for i in range(len(hosts)):
            counts[i] = min(slots[i], left)
            left -= counts[i]
    used = [(h, c) for h, c in zip(hosts, counts, strict=True) if c]
    ranks, next_rank = [], 0
    for _, count in used:
        ranks.append(list(range(next_rank, next_rank + count)))
        next_rank += count
    return Placement([h for h, _ in used], ranks)
