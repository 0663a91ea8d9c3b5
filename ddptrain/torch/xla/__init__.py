"""torch_xla under Ray Train's names: change ``ray.train.torch.xla`` to ``ddptrain.torch.xla``.

Importing it does not import torch_xla; the workers check that they can (see
:class:`TorchXLAConfig`).
"""

from ddptrain.torch.xla.config import TorchXLAConfig

__all__ = ["TorchXLAConfig"]
