"""``Backend`` and ``BackendConfig``: per-framework setup and teardown of the worker group.

A backend's hooks run in the driver and reach the workers through
``worker_group.execute(fn, *args)``, which runs ``fn`` in every worker and returns the
results in rank order.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddptrain.driver.worker_group import WorkerGroup

__all__ = ["Backend", "BackendConfig"]


@dataclasses.dataclass
class BackendConfig:
    """Configuration of a :class:`Backend`. Subclass it and return your backend from ``backend_cls``.

    Example:
        >>> class MyBackendConfig(BackendConfig):
        ...     env_var: str = "value"
        ...
        ...     @property
        ...     def backend_cls(self):
        ...         return MyBackend
    """

    @property
    def backend_cls(self) -> type[Backend]:
        """The :class:`Backend` class this config sets up."""
        return Backend

    @property
    def train_func_context(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        """A context-manager factory wrapped around the training function in each worker."""
        return contextlib.nullcontext

    def make_backend(self) -> Backend:
        """A new :class:`Backend` of this config (``backend_cls`` may be a property, as in Ray,
        or a method)."""
        made: Any = self.backend_cls()
        return made() if isinstance(made, type) else made

    def shares_visible_gpus(self) -> bool:
        """Whether the workers of this backend on one host all see that host's GPUs (torch's,
        for NCCL) or each only its own (every other backend, as in Ray)."""
        return bool(getattr(self.make_backend(), "share_cuda_visible_devices", False))

    def to_dict(self) -> dict[str, Any]:
        """The config's fields as a dict."""
        return dataclasses.asdict(self) if dataclasses.is_dataclass(self) else dict(vars(self))


class Backend:
    """Hooks run by the driver around the training function.

    ``on_start`` runs once the workers are up, ``on_training_start`` right before the training
    function, ``on_shutdown`` after it finished (its errors are logged, not raised).
    """

    share_cuda_visible_devices: bool = False

    def on_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        """Set up the workers (e.g. a process group)."""

    def on_training_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        """Last step before the training function runs."""

    def on_shutdown(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        """Tear down what ``on_start`` set up."""
