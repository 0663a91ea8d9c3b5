"""PyTorch Lightning in a ddptrain ``TorchTrainer``, under Ray Train's names.

Change ``ray.train.lightning`` to ``ddptrain.lightning``::

    import lightning.pytorch as pl  # or: import pytorch_lightning as pl
    from ddptrain.lightning import (RayDDPStrategy, RayLightningEnvironment,
                                    RayTrainReportCallback, prepare_trainer)

    def train_func():
        trainer = pl.Trainer(devices="auto", accelerator="auto", strategy=RayDDPStrategy(),
                             plugins=[RayLightningEnvironment()],
                             callbacks=[RayTrainReportCallback()])
        trainer = prepare_trainer(trainer)
        trainer.fit(model, datamodule=dm)

Both Lightning packages work: ``lightning`` (``import lightning.pytorch``) and the standalone
``pytorch_lightning``. The classes here build an object of the package your code uses (the one
the calling code refers to, else the one imported); when that cannot be told apart, the error
says so and names ``ddptrain.lightning.lightning`` and ``ddptrain.lightning.pytorch_lightning``,
which hold one package's classes each.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import FrameType, ModuleType
from typing import Any

from ddptrain.errors import ConfigError

__all__ = [
    "MODEL_KEY",
    "LightningConfigBuilder",
    "LightningTrainer",
    "PackageMismatchError",
    "RayDDPStrategy",
    "RayDeepSpeedStrategy",
    "RayFSDPStrategy",
    "RayLightningEnvironment",
    "RayModelParallelStrategy",
    "RayTrainReportCallback",
    "prepare_trainer",
]

_PACKAGES = ("lightning", "pytorch_lightning")
_TRAINER_MODULES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}


def _installed(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


if not any(_installed(name) for name in _PACKAGES):
    raise ImportError(
        "ddptrain.lightning needs PyTorch Lightning, which is not installed: "
        "`pip install ddptrain[lightning]` (or `pip install lightning`)."
    )


class PackageMismatchError(ConfigError):
    """Objects of the ``lightning`` and the ``pytorch_lightning`` packages were mixed, or
    ddptrain cannot tell which one the code uses."""


def _package_of_name(name: str) -> str | None:
    """``"lightning"``/``"pytorch_lightning"`` for names of those packages' modules (and of
    ours built on them), else ``None``."""
    for package, ours in (
        ("pytorch_lightning", "ddptrain.lightning.pytorch_lightning"),
        ("lightning", "ddptrain.lightning.lightning"),
    ):
        if name in (package, ours) or name.startswith(package + "."):
            return package
    return None


def _packages_referred_by(frame: FrameType) -> set[str]:
    """The Lightning packages that the modules and classes visible in ``frame`` come from."""
    found = set()
    for namespace in (frame.f_locals, frame.f_globals):
        for value in list(namespace.values()):
            if isinstance(value, ModuleType):
                name = value.__name__
            elif isinstance(value, type):
                name = value.__module__
            else:
                continue
            package = _package_of_name(name)
            if package:
                found.add(package)
    return found


def _user_package(frame: FrameType | None, what: str) -> str:
    """The Lightning package the code in ``frame`` uses."""
    referred = _packages_referred_by(frame) if frame is not None else set()
    if len(referred) == 1:
        return referred.pop()
    imported = {p for p in _PACKAGES if sys.modules.get(_TRAINER_MODULES[p]) is not None}
    if len(imported) == 1 and not referred:
        return imported.pop()
    installed = [p for p in _PACKAGES if _installed(p)]
    if len(installed) == 1:
        return installed[0]
    if referred:
        state = "used by the calling code"
    elif imported:
        state = "imported"
    else:
        state = "installed and neither is imported yet"
    raise PackageMismatchError(
        f"`{what}()`: both `lightning` (`import lightning.pytorch`) and `pytorch_lightning` are "
        f"{state}, and ddptrain cannot tell which one "
        "your Trainer comes from. Use one package in a script, or import the class for yours: "
        f"`from ddptrain.lightning.lightning import {what}` (for `lightning`) or "
        f"`from ddptrain.lightning.pytorch_lightning import {what}` (for `pytorch_lightning`)."
    )


def _classes(package: str) -> ModuleType:
    return importlib.import_module(f"ddptrain.lightning.{package}")


def _loaded_class_sets() -> list[ModuleType]:
    return [sys.modules[f"ddptrain.lightning.{p}"] for p in _PACKAGES if f"ddptrain.lightning.{p}" in sys.modules]


class _PerPackage(type):
    """Calling one of the public classes builds the object of the same name for the user's
    Lightning package; ``isinstance`` accepts the objects of either package."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not cls.__dict__.get("_dispatch", False):
            raise TypeError(
                f"Subclass the {cls.__mro__[1].__name__} of your Lightning package instead: "
                f"`ddptrain.lightning.lightning.{cls.__mro__[1].__name__}` or "
                f"`ddptrain.lightning.pytorch_lightning.{cls.__mro__[1].__name__}`."
            )
        package = _user_package(sys._getframe(1), cls.__name__)
        built = getattr(_classes(package), cls.__name__)
        if built is None:
            raise ImportError(f"{cls.__name__} needs a newer `{package}`: `pip install -U {package}` (2.4 or later).")
        return built(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return any(isinstance(obj, built) for built in _built(cls.__name__))

    def __subclasscheck__(cls, sub: Any) -> bool:
        if type.__subclasscheck__(cls, sub):
            return True
        return any(issubclass(sub, built) for built in _built(cls.__name__))


def _built(name: str) -> list[type]:
    """The class ``name`` of each Lightning package loaded so far (where that package has it)."""
    return [getattr(module, name) for module in _loaded_class_sets() if getattr(module, name) is not None]


class RayLightningEnvironment(metaclass=_PerPackage):
    """Lightning's ``LightningEnvironment`` for a ddptrain worker: world size and ranks come from
    :func:`ddptrain.get_context`; the process group ddptrain set up is used as it is.

    Pass it as ``pl.Trainer(plugins=[RayLightningEnvironment()])``.
    """

    _dispatch = True


class RayDDPStrategy(metaclass=_PerPackage):
    """Lightning's ``DDPStrategy`` for a ddptrain worker.

    The root device is :func:`ddptrain.torch.get_device` (so ``devices="auto"`` works on CPU
    and GPU, and with unequal worker counts per host) and the distributed sampler gets the
    worker's rank and the world size. ``process_group_backend`` and ``timeout`` are ignored
    (with a warning): ddptrain made the process group; set them with ``TorchConfig``.
    """

    _dispatch = True


class RayFSDPStrategy(metaclass=_PerPackage):
    """Lightning's ``FSDPStrategy`` for a ddptrain worker (see :class:`RayDDPStrategy`)."""

    _dispatch = True


class RayDeepSpeedStrategy(metaclass=_PerPackage):
    """Lightning's ``DeepSpeedStrategy`` for a ddptrain worker (see :class:`RayDDPStrategy`)."""

    _dispatch = True


class RayModelParallelStrategy(metaclass=_PerPackage):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 with ``fully_shard``, tensor parallelism) for
    a ddptrain worker; not in Ray. Needs Lightning 2.4 or later, and runs on CPU (gloo) as well.

    The root device is :func:`ddptrain.torch.get_device`. ``data_parallel_size="auto"`` and
    ``tensor_parallel_size="auto"`` mean one tensor-parallel group per host and data parallelism
    across hosts; pass both when the hosts run unequal numbers of workers. The distributed
    sampler follows the data-parallel dimension, as in Lightning.
    """

    _dispatch = True


class RayTrainReportCallback(metaclass=_PerPackage):
    """A Lightning callback that reports metrics and a checkpoint to ddptrain at the end of each
    training epoch (or every ``frequency`` epochs or steps).

    The checkpoint folder holds ``CHECKPOINT_NAME`` (``"checkpoint.ckpt"``), written by
    ``trainer.save_checkpoint``, as in Ray. Metrics are ``trainer.callback_metrics`` as numbers
    plus ``epoch`` and ``step``.

    Args:
        frequency: Checkpoint every ``frequency`` epochs or optimizer steps (default 1).
        frequency_unit: ``"epoch"`` (default) or ``"step"``.
        checkpoint_upload_mode: Passed to :func:`ddptrain.report`.

    Example:
        >>> with result.checkpoint.as_directory() as d:
        ...     model = MyModule.load_from_checkpoint(
        ...         os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME))
    """

    _dispatch = True
    CHECKPOINT_NAME = "checkpoint.ckpt"


def _package_of(obj: Any) -> str | None:
    for cls in type(obj).__mro__:
        package = _package_of_name(cls.__module__)
        if package:
            return package
    return None


def prepare_trainer(trainer: Any) -> Any:
    """Check a Lightning ``Trainer`` for a ddptrain worker and return it.

    Checks that the strategy is :class:`RayDDPStrategy`, :class:`RayFSDPStrategy`,
    :class:`RayDeepSpeedStrategy` or :class:`RayModelParallelStrategy`, that the cluster environment is
    :class:`RayLightningEnvironment`, and that nothing of the other Lightning package is mixed
    in. It also makes ``fit`` warn when it would not resume from the checkpoint a restarted run
    got (``ddptrain.get_checkpoint()``): when ``ckpt_path`` is missing, or points elsewhere.

    Args:
        trainer: A ``lightning.pytorch.Trainer`` or ``pytorch_lightning.Trainer``.

    Returns:
        The same trainer.

    Raises:
        RuntimeError: Not a ddptrain strategy or environment.
        PackageMismatchError: Objects of both Lightning packages are mixed.
    """
    package = _package_of(trainer)
    if package is None:
        raise TypeError(f"`prepare_trainer` expects a Lightning Trainer, got {type(trainer).__name__}.")
    classes = _classes(package)
    others = [p for p in _PACKAGES if p != package]
    for obj in [trainer.strategy, trainer.strategy.cluster_environment, *trainer.callbacks]:
        found = _package_of(obj)
        if found in others:
            raise PackageMismatchError(
                f"The Trainer comes from `{_TRAINER_MODULES[package]}` but {type(obj).__name__} from "
                f"`{_TRAINER_MODULES[found]}`: use one Lightning package (`lightning` or "
                f"`pytorch_lightning`) for the Trainer, the strategy, plugins and callbacks, e.g. "
                f"`from ddptrain.lightning.{package} import {type(obj).__name__}`."
            )
    ray_strategies = tuple(
        strategy
        for strategy in (
            classes.RayDDPStrategy,
            classes.RayFSDPStrategy,
            classes.RayDeepSpeedStrategy,
            classes.RayModelParallelStrategy,
        )
        if strategy is not None
    )
    if not isinstance(trainer.strategy, ray_strategies):
        raise RuntimeError(
            f"prepare_trainer: the Trainer's strategy is {type(trainer.strategy).__name__}; use "
            "`strategy=RayDDPStrategy()` (or RayFSDPStrategy / RayDeepSpeedStrategy / RayModelParallelStrategy) "
            "from ddptrain.lightning."
        )
    if not isinstance(trainer.strategy.cluster_environment, classes.RayLightningEnvironment):
        raise RuntimeError(
            f"prepare_trainer: the Trainer's cluster environment is "
            f"{type(trainer.strategy.cluster_environment).__name__}; pass "
            "`plugins=[RayLightningEnvironment()]` from ddptrain.lightning."
        )
    if not any(isinstance(cb, classes._ResumeCheck) for cb in trainer.callbacks):
        trainer.callbacks.append(classes._ResumeCheck())
    return trainer


from ddptrain.lightning.lightning_trainer import MODEL_KEY, LightningConfigBuilder, LightningTrainer  # noqa: E402
