"""The SLURM allocation this process runs in, as the driver reads it: its nodes
(``SLURM_JOB_NODELIST`` expanded as ``scontrol show hostnames`` does), the workers each node
takes, and the addresses the driver and the nodes reach each other at.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Mapping

from ddptrain.errors import ConfigError, LaunchError
from ddptrain.launch.hosts import HostSpec, slots_for_gpus

__all__ = ["allocation_hosts", "expand_nodelist", "node_address", "route_source", "tasks_per_node"]

_SCONTROL_TIMEOUT_S = 30.0


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' without ']'")
    parts.append(text[start:])
    return parts


def _expand_range(body: str) -> list[str]:
    """``01-03,7`` -> ``["01", "02", "03", "7"]``: each range keeps its first number's width."""
    out = []
    for part in body.split(","):
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"bad range {part!r}")
        if not sep:
            out.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"range {part!r} runs backwards")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def _expand_one(item: str) -> list[str]:
    """One host expression: a name with any number of ``[ranges]`` (their cartesian product)."""
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        if "[" in item or "]" in item:
            raise ValueError(f"unbalanced brackets in {item!r}")
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    return [head + n + rest for n in _expand_range(match.group(1)) for rest in _expand_one(tail)]


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list, in order, as ``scontrol show hostnames`` prints them:
    ``n[0-3,7],gpu-a[01-02]`` -> ``n0 n1 n2 n3 n7 gpu-a01 gpu-a02``.

    Raises:
        ConfigError: The list is malformed.
    """
    try:
        names = [name for item in _split_top(nodelist.strip()) if item for name in _expand_one(item)]
    except ValueError as exc:
        raise ConfigError(f"cannot read the SLURM node list {nodelist!r}: {exc}.") from None
    if not names:
        raise ConfigError(f"the SLURM node list is empty ({nodelist!r}).")
    return names


def tasks_per_node(text: str, nodes: int) -> list[int]:
    """SLURM's per-node counts (``SLURM_TASKS_PER_NODE``, ``SLURM_JOB_CPUS_PER_NODE``):
    ``2(x3),1`` -> ``[2, 2, 2, 1]``; a single number applies to every node.

    Raises:
        ConfigError: Malformed, or not one count per node.
    """
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ConfigError(f"cannot read the SLURM per-node count {text!r} (expected e.g. `2(x3),1`).")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) == 1:
        counts *= nodes
    if len(counts) != nodes:
        raise ConfigError(f"the SLURM per-node count {text!r} gives {len(counts)} counts for {nodes} nodes.")
    return counts


def _gpus_on_node(env: Mapping[str, str]) -> int | None:
    """GPUs the allocation gives each node: ``SLURM_GPUS_ON_NODE``, else ``SLURM_JOB_GPUS``'s ids
    (both set on the batch host), else ``SLURM_GPUS_PER_NODE`` (``--gpus-per-node=[type:]N``:
    all an ``salloc`` shell, which runs outside the job's nodes, is told). A step of the job
    without GPUs of its own (salloc's interactive step) says 0 on node: the others are asked."""
    on_node = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if on_node.isdigit() and int(on_node) > 0:
        return int(on_node)
    ids = [i for i in env.get("SLURM_JOB_GPUS", "").split(",") if i.strip()]
    if ids:
        return len(ids)
    asked = env.get("SLURM_GPUS_PER_NODE", "").strip().rsplit(":", 1)[-1]
    return int(asked) if asked.isdigit() else None


def allocation_hosts(
    env: Mapping[str, str] | None = None, use_gpu: bool = False, gpus_per_worker: float = 1.0
) -> list[HostSpec]:
    """The nodes of the SLURM job this process runs in, with their slots (workers).

    Slots per node: ``SLURM_NTASKS_PER_NODE`` (``--ntasks-per-node``); else, with ``use_gpu``,
    one per ``gpus_per_worker`` of the node's GPUs (``SLURM_GPUS_ON_NODE`` / ``SLURM_JOB_GPUS`` /
    ``SLURM_GPUS_PER_NODE``);
    else ``SLURM_TASKS_PER_NODE`` (``--ntasks``, e.g. ``2(x3),1``); else ``SLURM_CPUS_ON_NODE``.

    Raises:
        ConfigError: Not inside an allocation, or its variables are malformed.
    """
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError(
            '`hosts="slurm"` runs on the nodes of a SLURM allocation, but this process is not in one '
            "(SLURM_JOB_NODELIST is not set). Run the script in an `sbatch` script or an `salloc` shell, "
            'or give a host file instead of "slurm".'
        )
    nodes = expand_nodelist(nodelist)
    explicit = env.get("SLURM_NTASKS_PER_NODE", "").strip()
    gpus = _gpus_on_node(env) if use_gpu else None
    if explicit:
        slots = tasks_per_node(explicit, len(nodes))
    elif gpus is not None:
        slots = [slots_for_gpus(gpus, gpus_per_worker)] * len(nodes)
    elif env.get("SLURM_TASKS_PER_NODE"):
        slots = tasks_per_node(env["SLURM_TASKS_PER_NODE"], len(nodes))
    elif env.get("SLURM_CPUS_ON_NODE"):
        slots = tasks_per_node(env["SLURM_CPUS_ON_NODE"], len(nodes))
    else:
        slots = [1] * len(nodes)
    return [HostSpec(name=node, slots=count, srun=True) for node, count in zip(nodes, slots, strict=True)]


def node_address(node: str) -> str:
    """The address SLURM reaches ``node`` at (its ``NodeAddr``), else what its name resolves to.

    Raises:
        LaunchError: Neither is known.
    """
    try:
        out = subprocess.run(
            ["scontrol", "-o", "show", "node", node],
            capture_output=True,
            text=True,
            timeout=_SCONTROL_TIMEOUT_S,
            check=False,
        ).stdout
        match = re.search(r"\bNodeAddr=(\S+)", out)
        if match:
            return match.group(1)
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        return str(socket.getaddrinfo(node, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as exc:
        raise LaunchError(f"node {node!r}: neither `scontrol show node` nor DNS gives its address ({exc}).") from None


def route_source(address: str) -> str:
    """This machine's address on the route to ``address``: where that host reaches it back."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 6818))  # UDP: picks the route, sends nothing
        return str(probe.getsockname()[0])
