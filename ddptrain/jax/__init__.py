"""JAX in ddptrain workers, under Ray Train's names: change ``ray.train.v2.jax`` to
``ddptrain.jax``.

``JaxTrainer`` starts ``jax.distributed`` in every worker before the training function (on
CPUs too, with gloo collectives), so the workers form one multi-process JAX runtime.
Needs ``pip install ddptrain[jax]``; neither ``import ddptrain`` nor this package imports JAX
in the driver.
"""

import socket as _socket
import sys as _sys

from ddptrain.jax.config import _missing_jax

if _missing_jax():  # in the driver, or in a worker's agent loading the training function
    raise ImportError(
        f"ddptrain.jax needs jax, which this Python ({_sys.executable} on host {_socket.gethostname()}) cannot "
        "import: `pip install ddptrain[jax]` (add `jax[cuda12]` for NVIDIA GPUs)."
    )

from ddptrain.jax.config import JaxConfig  # noqa: E402
from ddptrain.jax.jax_trainer import JaxTrainer  # noqa: E402

__all__ = ["JaxConfig", "JaxTrainer"]
