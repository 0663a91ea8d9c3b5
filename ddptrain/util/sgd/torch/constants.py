"""The names RaySGD's PyTorch side shares between the trainer, its workers and user code
(``ray.util.sgd.torch.constants``): the accepted ``scheduler_step_freq`` values, and the
``info`` key that carries a ``train()``/``validate()`` call's ``num_steps``.
"""

__all__ = [
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
