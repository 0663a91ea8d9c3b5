"""The names RaySGD's PyTorch side shares between the trainer, its workers and user code
(``ray.util.sgd.torch.constants``): the accepted ``scheduler_step_freq`` values, the
``info`` key that carries a ``train()``/``validate()`` call's ``num_steps``, and
``NCCL_TIMEOUT_S`` (the environment variable's value when this module was imported, else 1800;
``TorchTrainer`` reads the variable again when it is built).
"""

from ddptrain import _env

__all__ = [
    "NCCL_TIMEOUT_S",
    "NUM_STEPS",
    "SCHEDULER_STEP_BATCH",
    "SCHEDULER_STEP_EPOCH",
    "SCHEDULER_STEP_MANUAL",
    "VALID_SCHEDULER_STEP",
]

SCHEDULER_STEP_BATCH = "batch"
SCHEDULER_STEP_EPOCH = "epoch"
SCHEDULER_STEP_MANUAL = "manual"
VALID_SCHEDULER_STEP = (SCHEDULER_STEP_BATCH, SCHEDULER_STEP_EPOCH, SCHEDULER_STEP_MANUAL, None)
NUM_STEPS = "num_steps"
NCCL_TIMEOUT_S = int(_env.nccl_timeout_s() or 1800)
