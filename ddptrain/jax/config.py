"""``JaxConfig`` and the backend that starts ``jax.distributed`` in every worker.

Before the training function runs, every worker calls ``jax.distributed.initialize`` with
rank 0's address and a port rank 0 found free (sent to the others through the driver's
store), ``num_processes=world_size`` and ``process_id=rank``, on CPUs as on GPUs, so
``jax.devices()`` spans every worker and a ``psum`` sums across them. CPU collectives run over
gloo (set explicitly: older JAX releases had none by default). After a successful run every
worker calls ``jax.distributed.shutdown()`` together (JAX's shutdown barrier is then met at
once) and clears JAX's backends, so a warm worker can initialize again for the next run.
Workers leave with ``os._exit`` as always: a Python exit would run JAX's shutdown barrier
alone, which waits for the peers (up to its ``shutdown_timeout_seconds``) and then aborts.

Nothing here imports JAX in the driver.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddptrain import _env
from ddptrain._net import own_address
from ddptrain.backend import Backend, BackendConfig
from ddptrain.errors import ConfigError, LaunchError

if TYPE_CHECKING:
    from ddptrain.driver.worker_group import WorkerGroup

__all__ = ["JaxConfig"]

_logger = logging.getLogger(__name__)

# JAX's shutdown barrier: how long a worker's `jax.distributed.shutdown()` waits for the
# others (all of them call it at once, after the training function returned everywhere).
_SHUTDOWN_BARRIER_S = 30

# In each worker: whether this module started jax.distributed there (and has not shut it down).
_started = False


@dataclass
class JaxConfig(BackendConfig):
    """How workers join one multi-process JAX runtime (Ray Train's ``JaxConfig``).

    Every worker calls ``jax.distributed.initialize`` before the training function, on CPUs
    too (Ray does it on TPUs and GPUs only), with CPU collectives over gloo: ``jax.devices()``
    lists the devices of every worker and ``jax.lax.psum`` under ``shard_map`` sums across
    them. With ``use_gpu`` each worker sees only its own GPUs.

    Args:
        use_tpu: TPUs are not supported by ddptrain; must be False.
        use_gpu: JAX runs on CUDA (``jax_platforms="cuda"``) on each worker's own GPUs;
            otherwise on the CPU (``"cpu"``). ``JAX_PLATFORMS`` in the workers' environment
            wins over both. ``JaxTrainer`` takes it from ``ScalingConfig.use_gpu`` by default.
    """

    use_tpu: bool = False
    use_gpu: bool = False

    def __post_init__(self) -> None:
        for name in ("use_tpu", "use_gpu"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")
        if self.use_tpu:
            raise ConfigError("`JaxConfig(use_tpu=True)` is not supported by ddptrain: JAX runs on CPUs or CUDA GPUs.")

    @property
    def backend_cls(self) -> type[Backend]:
        return _JaxBackend


def _missing_jax() -> bool:
    """Whether this Python cannot import ``jax`` (checked without importing it)."""
    if "jax" in sys.modules:
        return sys.modules["jax"] is None
    try:
        return importlib.util.find_spec("jax") is None
    except (ImportError, ValueError):
        return True


def _free_port() -> int:
    """A port free on every interface (JAX's coordinator binds ``[::]:port``), released
    again at once: another process could still take it before JAX binds it."""
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        address = "::"
    except OSError:
        s, address = socket.socket(socket.AF_INET, socket.SOCK_STREAM), ""
    with s:
        s.bind((address, 0))
        port: int = s.getsockname()[1]
    return port


def _gloo_address() -> str | None:
    """The address gloo listens on for JAX's CPU collectives: the first one this host's name
    resolves to (JAX offers no setting for it); ``None``: the name does not resolve."""
    try:
        return str(socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return None


def _uses_cpu() -> bool:
    """Whether JAX will run on the CPU in this worker (then gloo carries its collectives)."""
    import jax

    config: Any = jax.config  # its flags are attributes mypy does not know
    return "cpu" in (config.jax_platforms or "cpu").split(",")


_GLOO = "gloo, which carries JAX's CPU collectives, listens on the address the host name resolves to"


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _modules_holding_jax_arrays(jax: Any) -> list[str]:
    """Modules (other than JAX's own) with a JAX array at top level: computed when imported."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] in ("jax", "jaxlib", "optax", "flax", "chex", "orbax"):
            continue
        try:
            values = list(vars(module).values())
        except TypeError:
            continue
        # By type only: looking at a value could run its code (deprecation warnings, lazy modules).
        if any(issubclass(type(value), jax.Array) for value in values):
            found.append(name)
    return sorted(found)


def _already_used_error(jax: Any) -> ConfigError:
    rank, host = os.environ.get("RANK", "?"), socket.gethostname()
    modules = _modules_holding_jax_arrays(jax)
    culprit = (
        f"module(s) {', '.join(modules)} computed JAX arrays when imported"
        if modules
        else "a module imported with the training function called JAX when imported (a computation, "
        "jax.devices(), jax.device_put, ...), or the training function or its config holds a JAX array (pickled "
        "with it, it is rebuilt with JAX here: pass numpy arrays instead)"
    )
    return ConfigError(
        f"JaxTrainer: rank {rank} on host {host} had already started JAX before ddptrain could call "
        f"jax.distributed.initialize, which must come before any other JAX call: {culprit}. Move JAX calls out "
        "of module top level into the training function (importing jax at the top is fine)."
    )


def _prepare(use_gpu: bool) -> dict[str, Any]:
    """Runs on each worker: check that JAX can start distributed here, select its platform
    and CPU collectives; rank 0 also picks the coordinator's port."""
    rank, host = int(os.environ["RANK"]), socket.gethostname()
    import jax  # importable: loading this module's package checked it

    if _started:  # a warm worker whose last run's shutdown did not happen: finish it now
        _shutdown()
    if jax.distributed.is_initialized():
        raise ConfigError(
            f"JaxTrainer: jax.distributed was already initialized in rank {rank} on host {host} before the "
            "training function ran (a module imported with it called jax.distributed.initialize). JaxTrainer "
            "initializes it: remove that call."
        )
    if _backends_initialized():
        raise _already_used_error(jax)
    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cuda" if use_gpu else "cpu")
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # older JAX had a switch instead
        jax.config.update("jax_cpu_enable_gloo_collectives", True)
    address = own_address()
    if _uses_cpu() and _gloo_address() is None:  # else the first JAX call fails with "rv == 0. -3 vs 0"
        raise LaunchError(
            f"JaxTrainer: the name of host {host} (rank {rank}) does not resolve to an address, and {_GLOO} "
            f"(JAX has no setting for it). Make {host!r} resolve to the address the other workers reach this "
            f"host at ({address}), e.g. in /etc/hosts or DNS.",
            hosts=[host],
        )
    return {"address": address, "port": _free_port() if rank == 0 else None}


def _backends_initialized() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # jax.distributed.initialize says it too, less clearly
        return False
    return bool(xla_bridge.backends_are_initialized())


def _initialize(coordinator: str, world_size: int, timeout_s: float, spans_hosts: bool) -> None:
    """Runs on each worker: join the run's JAX runtime (``process_id`` = world rank)."""
    global _started
    import jax

    rank, host = int(os.environ["RANK"]), socket.gethostname()
    config: Any = jax.config  # its flags are attributes mypy does not know
    platforms = (config.jax_platforms or "").split(",")
    gloo = _gloo_address() or "?"
    if spans_hosts and _uses_cpu() and _is_loopback(gloo) and not _is_loopback(own_address()):
        raise LaunchError(
            f"JaxTrainer: {_GLOO} (JAX has no setting for it), and {host!r} resolves to {gloo}, which the other "
            f"hosts cannot reach. Make {host!r} resolve to the address the other hosts reach this host at "
            f"({own_address()}), e.g. in /etc/hosts or DNS.",
            hosts=[host],
        )
    kwargs: dict[str, Any] = {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if "cuda" in platforms and visible:  # this worker's own GPUs (narrowed by ddptrain)
        kwargs["local_device_ids"] = list(range(len(visible.split(","))))
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=world_size,
            process_id=rank,
            initialization_timeout=max(1, int(timeout_s)),
            shutdown_timeout_seconds=_SHUTDOWN_BARRIER_S,
            **kwargs,
        )
    except RuntimeError as exc:
        if "must be called before" in str(exc):  # JAX was used since _prepare (another thread?)
            raise _already_used_error(jax) from exc
        raise
    _started = True


def _shutdown() -> None:
    """Runs on each worker, every worker at once: leave the JAX runtime and clear JAX's
    backends, so that this process can initialize again for the next run of a warm group."""
    global _started
    if not _started:
        return
    import jax
    from jax.extend.backend import clear_backends

    _started = False
    jax.distributed.shutdown()
    clear_backends()


def _coordinator(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


class _JaxBackend(Backend):
    def on_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, JaxConfig)
        gpus = worker_group.get_resources_per_worker().get("GPU") or 0
        if backend_config.use_gpu and not gpus:
            raise ConfigError(
                "`JaxConfig(use_gpu=True)` but the workers have no GPUs: set `ScalingConfig(use_gpu=True)`."
            )
        found = worker_group.execute(_prepare, backend_config.use_gpu)
        coordinator = _coordinator(found[0]["address"], found[0]["port"])
        spans_hosts = len({info["address"] for info in found}) > 1
        _logger.debug("ddptrain: JAX coordinator at %s", coordinator)
        timeout_s = _env.store_connect_timeout_s()
        worker_group.execute(_initialize, coordinator, len(worker_group), timeout_s, spans_hosts)

    def on_shutdown(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        worker_group.execute(_shutdown)
