"""What a running trial sees: ``tune.report``, ``tune.get_checkpoint``, ``tune.get_context``.

Each trial runs in its own thread of the sweep's process (see ``ddptrain.tune.tuner``), so
the trial's session is thread-local. Inside a ddptrain training worker (a trainer run by the
sweep) there is no trial session: there ``tune.report`` is ``ddptrain.report``.

A function trial therefore shares the sweep's CUDA devices: it cannot have a
``CUDA_VISIBLE_DEVICES`` of its own, and torch numbers devices by their position in the sweep
process's ``CUDA_VISIBLE_DEVICES``. ``get_gpu_ids()`` gives the GPU ids it was granted (as the
sweep's ``CUDA_VISIBLE_DEVICES`` names them, like Ray's); ``get_devices()`` gives the torch
devices they are in this process.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ddptrain
from ddptrain.checkpoint import Checkpoint
from ddptrain.errors import DdpTrainError
from ddptrain.launch.hosts import GpuId, visible_gpu_ids
from ddptrain.tune.trial import Trial

if TYPE_CHECKING:
    import torch

__all__ = ["TrialStopped", "TuneContext", "report", "get_checkpoint", "get_context"]

_local = threading.local()


class TrialStopped(BaseException):
    """Raised in a trial's thread at a report when the sweep stops the trial (a scheduler, the
    ``stop=`` criteria, the time budget). A ``BaseException``, so that ``except Exception`` in
    user code does not swallow it; the sweep catches it and ends the trial as ``TERMINATED``."""


class TuneContext:
    """The running trial: its id, name and folder (Ray's ``tune.get_context()``)."""

    def __init__(self, session: TrialSession) -> None:
        self._session = session

    def get_trial_id(self) -> str:
        return self._session.trial.trial_id

    def get_trial_name(self) -> str:
        return self._session.trial.trial_name

    def get_trial_dir(self) -> str:
        """The trial's folder; a trainer fitted inside a function trainable can put its run here:
        ``RunConfig(storage_path=tune.get_context().get_trial_dir(), name="train")``."""
        return self._session.trial.path

    def get_experiment_name(self) -> str:
        return self._session.experiment_name

    def get_trial_resources(self) -> dict[str, float]:
        return dict(self._session.resources)

    def get_gpu_ids(self) -> list[GpuId]:
        """The GPU ids granted to the trial, as the sweep's ``CUDA_VISIBLE_DEVICES`` names them
        (``0..n-1`` when it is unset), like Ray's ``get_gpu_ids()``: ints for indices, strings
        for UUIDs (``CUDA_VISIBLE_DEVICES=GPU-3f2a...,GPU-77b1...``). In a function trial they are
        not torch's device indices when ``CUDA_VISIBLE_DEVICES`` is set: use :meth:`get_devices`."""
        return list(self._session.gpu_ids)

    def get_device_indices(self) -> list[int]:
        """Torch's CUDA indices, in the sweep's process, of :meth:`get_gpu_ids`: each id's position
        in the sweep's ``CUDA_VISIBLE_DEVICES`` (with ``CUDA_VISIBLE_DEVICES=2,3`` id 3 is
        ``cuda:1``), or the id itself when it is unset. Empty for a trial without GPUs.

        Raises:
            RuntimeError: A granted id is not in the ``CUDA_VISIBLE_DEVICES`` the trial started under.
        """
        return _device_indices(self._session.gpu_ids, self._session.visible_devices)

    def get_devices(self) -> list[torch.device]:
        """The torch devices of the trial's GPUs in the sweep's process (``cuda:<index>``, see
        :meth:`get_device_indices`); ``[cpu]`` for a trial without GPUs.

        A function trial runs in a thread of the sweep's process and sees every GPU the sweep
        sees: plain ``"cuda"`` is the thread's current device, ``cuda:0`` unless it is set. Put
        tensors and models on these devices, or call ``torch.cuda.set_device(get_device())``
        first in the trial (the current device is per thread), to stay on the GPUs granted.
        """
        import torch

        indices = self.get_device_indices()
        if not indices:
            return [torch.device("cpu")]
        return [torch.device("cuda", index) for index in indices]

    def get_device(self) -> torch.device:
        """The trial's first device: ``cuda:<index>`` in the sweep's process (see
        :meth:`get_devices`), ``cpu`` for a trial without GPUs."""
        return self.get_devices()[0]


def _device_indices(gpu_ids: list[GpuId], visible: str | None) -> list[int]:
    """Positions of ``gpu_ids`` in ``visible`` (a ``CUDA_VISIBLE_DEVICES`` value), as torch numbers
    the devices of a process started with it; the ids themselves when ``visible`` is ``None``
    (then they are indices)."""
    if visible is None:
        return [int(gpu) for gpu in gpu_ids]
    positions: dict[GpuId, int] = {}
    for position, gpu in enumerate(visible_gpu_ids(visible)):
        positions.setdefault(gpu, position)
    missing = [gpu for gpu in gpu_ids if gpu not in positions]
    if missing:
        raise RuntimeError(
            f"GPU id(s) {missing} granted to the trial are not in the sweep's CUDA_VISIBLE_DEVICES={visible!r}; "
            "do not change CUDA_VISIBLE_DEVICES while a sweep runs."
        )
    return [positions[gpu] for gpu in gpu_ids]


class TrialSession:
    """One trial's connection to the sweep.

    Args:
        trial: The trial.
        on_report: Called with each report (already augmented by the sweep); returns whether
            the trial must stop.
        experiment_name: The sweep's name.
        keep_checkpoints: How many checkpoints of a function trainable to keep (``None``: all).
    """

    def __init__(
        self,
        trial: Trial,
        on_report: Callable[[Trial, dict[str, Any], Checkpoint | None], bool],
        experiment_name: str,
        resources: dict[str, float],
        gpu_ids: list[GpuId],
        keep_checkpoints: int | None = None,
    ) -> None:
        self.trial = trial
        self.on_report = on_report
        self.experiment_name = experiment_name
        self.resources = resources
        self.gpu_ids = gpu_ids
        # What the granted ids are positions in (the sweep's process: torch's device numbering).
        self.visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.keep_checkpoints = keep_checkpoints
        self.stop_requested = False
        self.in_trainable = False  # the trial's thread runs the trainable (not the sweep's code)
        self._kept: list[str] = []

    def report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None = None, persisted: bool = False) -> None:
        """Hand one report to the sweep; raises :class:`TrialStopped` if the trial must stop.

        A checkpoint of a function trainable is copied into the trial's folder
        (``checkpoint_<iteration>``); one already persisted by a trainer (``persisted``) is
        referenced where it is.
        """
        if not isinstance(metrics, dict):
            raise TypeError(f"`metrics` must be a dict, got {type(metrics).__name__}.")
        if checkpoint is not None and not persisted:
            checkpoint = self._persist(checkpoint)
        stop = self.on_report(self.trial, dict(metrics), checkpoint)
        if stop or self.stop_requested:
            raise TrialStopped(self.trial.stop_reason or "stopped by the sweep")

    def _persist(self, checkpoint: Checkpoint) -> Checkpoint:
        target = os.path.join(self.trial.path, f"checkpoint_{self.trial.iteration + 1:06d}")
        staging = target + ".tmp"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(checkpoint.path, staging)
        shutil.rmtree(target, ignore_errors=True)
        os.rename(staging, target)  # a crash never leaves a half-copied checkpoint under its name
        self._kept.append(target)
        if self.keep_checkpoints is not None:
            while len(self._kept) > self.keep_checkpoints:
                shutil.rmtree(self._kept.pop(0), ignore_errors=True)
        return Checkpoint.from_directory(target)


def _set_session(session: TrialSession | None) -> None:
    _local.session = session


def _get_session() -> TrialSession | None:
    session: TrialSession | None = getattr(_local, "session", None)
    return session


def _in_training_worker() -> bool:
    try:
        ddptrain.get_context()
    except DdpTrainError:
        return False
    return True


def report(metrics: dict[str, Any], *, checkpoint: Checkpoint | None = None, **kwargs: Any) -> None:
    """Report a trial's metrics (and optionally a checkpoint) to the sweep.

    Each call is one iteration (``training_iteration`` counts them). The sweep's scheduler and
    ``stop=`` criteria decide after each call; when they stop the trial, this call does not
    return (it raises :class:`TrialStopped`, which the sweep catches: do not catch it).
    Inside a ddptrain training function (a trainer run by the sweep) it is ``ddptrain.report``.

    Raises:
        RuntimeError: Called outside a trial and outside a training function.

    Example:
        >>> def objective(config):
        ...     for step in range(10):
        ...         tune.report({"loss": (config["x"] - 3) ** 2 / (step + 1)})
    """
    session = _get_session()
    if session is None:
        if _in_training_worker():
            ddptrain.report(metrics, checkpoint=checkpoint, **kwargs)
            return
        raise RuntimeError(
            "`ddptrain.tune.report()` can only be called inside a trial run by `Tuner.fit()` / "
            "`tune.run()`, or inside a ddptrain training function."
        )
    session.report(metrics, checkpoint)


def get_checkpoint() -> Checkpoint | None:
    """The checkpoint a restarted or restored trial resumes from (``None`` on a fresh start).
    Inside a training function it is ``ddptrain.get_checkpoint()``."""
    session = _get_session()
    if session is None:
        return ddptrain.get_checkpoint()
    return session.trial.checkpoint


def get_context() -> TuneContext:
    """The running trial's context (id, name, folder).

    Raises:
        RuntimeError: Called outside a trial.
    """
    session = _get_session()
    if session is None:
        raise RuntimeError("`ddptrain.tune.get_context()` can only be called inside a trial.")
    return TuneContext(session)
