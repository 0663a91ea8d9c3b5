"""``import ray.train`` resolving to ddptrain: how ``ddptrain run`` runs unmodified Ray scripts.

:func:`install` puts an import finder first on ``sys.meta_path`` that answers for ``ray`` and
its submodules, whether or not the real ``ray`` package is installed:

* ``ray.train`` is ``ddptrain``, and ``ray.train.X`` is ``ddptrain.X`` (``ray.train.torch``,
  ``ray.train.lightning``, ``ray.train.huggingface.transformers``, ``ray.train.xgboost``...),
  and so is ``ray.train.v2.X`` (``ray.train.v2.jax``, where Ray keeps ``JaxTrainer``);
* ``ray.data``, ``ray.tune`` and ``ray.util.sgd`` are ``ddptrain.data``, ``ddptrain.tune`` and
  ``ddptrain.util.sgd`` (RaySGD left Ray in 2.0; mapping it is ddptrain's extension);
* ``ray.air`` and ``ray.air.config`` (Ray 2.0-2.6 spellings of the configs) are ddptrain's;
* ``ray`` itself is a small module with ``init``, ``shutdown``, ``is_initialized`` and
  ``cluster_resources`` (accepted and answered for this machine); any other Ray API raises
  :class:`RayAPIUnavailable`, naming it and what to use instead.

The mapping aliases modules: ``ray.train.torch`` *is* ``ddptrain.torch`` (same object), so
functions and classes pickle under their ddptrain names.

Every process that runs the script's own code gets the mapping, and no other program: the
workers of its trainers (the bootstrap says so, ``Bootstrap.ray_compat``: a module of the user's
that a worker imports may say ``import ray.train`` too), and the processes ``multiprocessing``
starts from any of these with ``spawn`` or ``forkserver`` (a ``Pool``, a ``Process``, a
``DataLoader``'s workers), which import the script again: their preparation data carries a hook
that installs the mapping before they do (:func:`install` adds it). Forked children inherit it.
A program the script starts (``subprocess.run([sys.executable, "other.py"])``) is not the
script: it gets ``ray`` as it would without ``ddptrain run``. Nothing goes through the
environment. The same hook hands ``ddptrain run --hosts``'s host file
(:func:`ddptrain._env.script_hostfile`) to those processes, under the same rule.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

from ddptrain import _env
from ddptrain.errors import DdpTrainError

__all__ = ["RayAPIUnavailable", "install", "installed", "target_of"]

# Ray module -> ddptrain module; a longer prefix wins. ``ray.train.<x>`` falls back to ``ddptrain.<x>``.
_PREFIXES = {
    "ray.train": "ddptrain",
    "ray.train.v2": "ddptrain",  # Ray Train V2's own package (``ray.train.v2.jax``: JaxTrainer)
    "ray.air.config": "ddptrain.config",
    "ray.air": "ddptrain",
    "ray.data": "ddptrain.data",
    "ray.tune": "ddptrain.tune",
    "ray.util.sgd": "ddptrain.util.sgd",
}

_INSTEAD = {
    "remote": "Ray tasks and actors do not exist under ddptrain: run the work inside the training function",
    "get": "there are no Ray object refs under ddptrain",
    "put": "there is no object store under ddptrain: pass data through `datasets=` or the config",
    "wait": "there are no Ray object refs under ddptrain",
    "kill": "ddptrain stops its own workers; raise in the training function to end a run",
    "nodes": "ddptrain has no cluster: `ScalingConfig(hosts=...)` lists the machines",
    "available_resources": "ddptrain has no cluster: see `ray.cluster_resources()` for this machine",
    "get_runtime_context": "use `ray.train.get_context()` inside the training function",
    "serve": "Ray Serve is not part of ddptrain",
    "rllib": "RLlib is not part of ddptrain",
}


class RayAPIUnavailable(DdpTrainError, AttributeError):
    """A Ray API that ddptrain does not provide was used under ``ddptrain run``."""


def target_of(name: str) -> str | None:
    """The ddptrain module that stands for Ray module ``name`` (``None``: no mapping)."""
    for prefix in sorted(_PREFIXES, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            return _PREFIXES[prefix] + name[len(prefix) :]
    return None


class _RayModule(types.ModuleType):
    """The top-level ``ray`` module under ``ddptrain run``."""

    __version__ = "2.53.0+ddptrain"

    def __init__(self) -> None:
        super().__init__("ray", "Ray's names, answered by ddptrain (see ddptrain.ray_compat).")
        self._initialized = False

    def __reduce__(self) -> tuple[Any, ...]:  # a function using `ray.train...` pickles it by name
        return (importlib.import_module, ("ray",))

    def init(self, *args: Any, **kwargs: Any) -> Any:
        """Accepted and ignored: ddptrain needs no cluster."""
        self._initialized = True
        return None

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        self._initialized = False

    def is_initialized(self) -> bool:
        return self._initialized

    def cluster_resources(self) -> dict[str, float]:
        """This machine's CPUs and GPUs (what a local run can use). GPUs are counted the way
        that does not start CUDA in this process (NVML's count; ``torch.cuda.is_available()``
        would start it, and the script is the driver of its runs)."""
        import torch

        resources = {"CPU": float(os.cpu_count() or 1)}
        gpus = torch.cuda.device_count()
        if gpus > 0:
            resources["GPU"] = float(gpus)
        return resources

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in ("train", "data", "tune", "air", "util"):
            return importlib.import_module(f"ray.{name}")
        instead = _INSTEAD.get(name, "ddptrain provides Ray Train's API (ray.train, ray.data, ray.tune, ray.util.sgd)")
        raise RayAPIUnavailable(f"`ray.{name}` is not available under ddptrain: {instead}.")


class _RayUtil(types.ModuleType):
    """``ray.util``: only ``ray.util.sgd`` is there."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (importlib.import_module, ("ray.util",))

    def __getattr__(self, name: str) -> Any:
        if name == "sgd":
            return importlib.import_module("ray.util.sgd")
        if name.startswith("__"):
            raise AttributeError(name)
        raise RayAPIUnavailable(f"`ray.util.{name}` is not available under ddptrain (only ray.util.sgd is).")


class _Alias(importlib.abc.Loader):
    """Loads a Ray module name as an existing module object (left as it was: the import
    system sets ``__spec__`` on what it loads, which is put back)."""

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module
        self._spec = getattr(module, "__spec__", None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self._module

    def exec_module(self, module: types.ModuleType) -> None:
        if self._spec is not None:  # already executed under its own name
            module.__spec__ = self._spec


class _RayFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "ray" and not fullname.startswith("ray."):
            return None
        if fullname == "ray":
            module: types.ModuleType = _RayModule()
        elif fullname == "ray.util":
            module = _RayUtil("ray.util")
        else:
            target_name = target_of(fullname)
            if target_name is None:
                raise ModuleNotFoundError(
                    f"No module named {fullname!r}: under ddptrain run, `ray` is ddptrain, which provides "
                    "ray.train, ray.data, ray.tune and ray.util.sgd.",
                    name=fullname,
                )
            try:
                module = importlib.import_module(target_name)
            except ModuleNotFoundError as exc:
                if exc.name is not None and exc.name.startswith("ddptrain"):
                    raise ModuleNotFoundError(
                        f"No module named {fullname!r}: ddptrain has no {target_name!r}.", name=fullname
                    ) from None
                raise
        is_package = hasattr(module, "__path__") or isinstance(module, (_RayModule, _RayUtil))
        spec = importlib.machinery.ModuleSpec(fullname, _Alias(module), is_package=is_package)
        if is_package:
            spec.submodule_search_locations = []
        return spec


_FINDER = _RayFinder()


def install() -> None:
    """Make ``import ray...`` resolve to ddptrain in this process and in the processes
    ``multiprocessing`` starts from it (see the module's docstring). Safe to call twice. Ray
    modules imported before (the real package) are dropped from ``sys.modules`` first."""
    if _FINDER not in sys.meta_path:
        for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _FINDER)
    _hook_multiprocessing()


def installed() -> bool:
    return _FINDER in sys.meta_path


# Run by a process that multiprocessing started with "spawn" or "forkserver" while it reads its
# preparation data, before `multiprocessing.spawn.prepare` imports the script again as
# `__mp_main__` (globals: `name`, the process's name; `parent`, the pid that started it;
# `sys_path`, the path `prepare` sets next; `hostfile`, the host file `ddptrain run --hosts`
# gave the script). Only the standard library is used before the mapping is installed, so that
# a failure to import ddptrain here is reported like any other.
# A Pool worker that cannot start (here, or while importing the script) would be replaced by
# the Pool with workers that fail the same way, forever: the process that started the Pool is
# interrupted instead (KeyboardInterrupt), after the worker's traceback.
_SPAWNED = """
import os, signal, sys

def excepthook(kind, value, tb, default=sys.excepthook):
    default(kind, value, tb)
    if "PoolWorker" in name and not issubclass(kind, KeyboardInterrupt):  # (Ctrl-C reached the parent too)
        print(
            "ddptrain run: multiprocessing Pool worker %s (pid %d) could not start (see above); the Pool would "
            "replace it with workers that fail the same way, forever, so the process that started the Pool "
            "(pid %d) is interrupted." % (name, os.getpid(), parent),
            file=sys.stderr,
            flush=True,
        )
        os.kill(parent, signal.SIGINT)

sys.excepthook = excepthook
sys.path[:] = sys_path
import ddptrain._env, ddptrain.ray_compat
ddptrain.ray_compat.install()
ddptrain._env.set_script_hostfile(hostfile)
"""
_PREPARATION_KEY = "ddptrain_ray_compat"


class _SpawnedHook:
    """An entry of the preparation data of a process that multiprocessing spawns: unpickling it
    runs ``_SPAWNED`` there."""

    def __init__(self, name: str, parent: int, sys_path: list[str], hostfile: str | None) -> None:
        self._globals = {"name": name, "parent": parent, "sys_path": list(sys_path), "hostfile": hostfile}

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (_SPAWNED, self._globals))


def _hook_multiprocessing() -> None:
    """Add a :class:`_SpawnedHook` to the preparation data of every process multiprocessing
    starts from this one with ``spawn`` or ``forkserver`` (both send it)."""
    from multiprocessing import spawn

    if getattr(spawn.get_preparation_data, "_ddptrain_ray_compat", False):
        return
    original = spawn.get_preparation_data

    def get_preparation_data(name: str) -> dict[str, Any]:
        data: dict[str, Any] = original(name)
        sys_path = data.get("sys_path") or sys.path
        data[_PREPARATION_KEY] = _SpawnedHook(name, os.getpid(), sys_path, _env.script_hostfile())
        return data

    get_preparation_data._ddptrain_ray_compat = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data
