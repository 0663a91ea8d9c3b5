"""The worker side of ``TorchTrainer``: one operator per worker process, kept in a module
global between the driver's calls (``WorkerGroup.execute`` runs the functions below).

Every function here is called on all workers at once unless its name says otherwise, and
runs the same collectives on each (DDP's gradient averaging, the sampler's epoch).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import cloudpickle
import torch

from ddptrain.context import get_context
from ddptrain.torch.train_loop_utils import get_device
from ddptrain.util.sgd.torch._creators import serialized_setup
from ddptrain.util.sgd.torch.constants import NUM_STEPS
from ddptrain.util.sgd.torch.training_operator import TrainingOperator

__all__: list[str] = []


class Runner:
    """One worker's operator and its epoch count."""

    def __init__(
        self,
        operator_cls: type[TrainingOperator],
        config: dict[str, Any],
        options: dict[str, Any],
        rank: int,
        local_rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        self.epochs = 0
        # setup() creates the data: one worker of this machine at a time, up to register().
        with serialized_setup(bool(options.get("serialize_data_creation"))):
            self.operator = self._build(operator_cls, config, options, rank, local_rank, world_size, device)

    @staticmethod
    def _build(
        operator_cls: type[TrainingOperator],
        config: dict[str, Any],
        options: dict[str, Any],
        rank: int,
        local_rank: int,
        world_size: int,
        device: torch.device,
    ) -> TrainingOperator:
        return operator_cls(
            config,
            world_rank=rank,
            local_rank=local_rank,
            is_distributed=world_size > 1,
            device=device,
            use_gpu=device.type == "cuda",
            use_fp16=options["use_fp16"],
            use_tqdm=options["use_tqdm"],
            wrap_ddp=options["wrap_ddp"],
            add_dist_sampler=options["add_dist_sampler"],
            scheduler_step_freq=options["scheduler_step_freq"],
            world_size=world_size,
        )

    def train_epoch(self, num_steps: int | None, profile: bool, info: dict[str, Any] | None) -> dict[str, Any]:
        op = self.operator
        loader = op.train_loader
        if loader is None:
            raise RuntimeError("train() needs a train_loader: call self.register_data(train_loader=...) in setup().")
        sampler: Any = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epochs)
        op.timers.enabled = profile
        op.timers.reset()
        info = {**(info or {}), NUM_STEPS: num_steps, "use_fp16": op.use_fp16, "epoch_idx": self.epochs}
        start = time.perf_counter()
        with op.timers.record("train_epoch"):
            stats = op.train_epoch(_iterate(loader, num_steps), info)
        self.epochs += 1
        result = {"epoch": self.epochs, **stats}
        if profile:
            timers = op.timers.stats()
            timers.setdefault("mean_train_epoch_s", time.perf_counter() - start)
            result["profile"] = timers
        op.timers.enabled = False
        return result

    def validate(self, num_steps: int | None, profile: bool, info: dict[str, Any] | None) -> dict[str, Any]:
        op = self.operator
        loader = op.validation_loader
        if loader is None:
            raise RuntimeError(
                "validate() needs a validation_loader: call self.register_data(validation_loader=...) in setup()."
            )
        op.timers.enabled = profile
        op.timers.reset()
        start = time.perf_counter()
        stats = op.validate(_iterate(loader, num_steps), {**(info or {}), NUM_STEPS: num_steps})
        if profile:
            stats["profile"] = {**op.timers.stats(), "mean_validate_s": time.perf_counter() - start}
        op.timers.enabled = False
        return stats

    def state_dict(self) -> dict[str, Any]:
        op = self.operator
        state = {
            "epoch": self.epochs,
            "global_step": op.global_step,
            "operator": op.state_dict(),
            "models": [model.state_dict() for model in op._get_original_models()],
            "optimizers": [optimizer.state_dict() for optimizer in op._optimizers],
            "schedulers": [scheduler.state_dict() for scheduler in op._schedulers],
            "amp": op._amp_scaler.state_dict() if op._amp_scaler is not None else None,
        }
        return _to_cpu(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        op = self.operator
        models = op._get_original_models()
        if len(state["models"]) != len(models):
            raise ValueError(
                f"The state has {len(state['models'])} model(s) but the operator registered {len(models)}: "
                "it was saved from a different TrainingOperator."
            )
        for model, model_state in zip(models, state["models"], strict=True):
            model.load_state_dict(model_state)
        for optimizer, optimizer_state in zip(op._optimizers, state["optimizers"], strict=False):
            optimizer.load_state_dict(optimizer_state)
        for scheduler, scheduler_state in zip(op._schedulers, state["schedulers"], strict=False):
            scheduler.load_state_dict(scheduler_state)
        if op._amp_scaler is not None and state.get("amp") is not None:
            op._amp_scaler.load_state_dict(state["amp"])
        self.epochs = state["epoch"]
        op.global_step = state.get("global_step", 0)
        if state.get("operator") is not None:
            op.load_state_dict(state["operator"])


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _iterate(loader: Iterable[Any], num_steps: int | None) -> Iterator[Any]:
    """The batches of one ``train()``/``validate()`` call: all of ``loader``, or its first ``num_steps``."""
    if num_steps is None:
        yield from loader
        return
    for index, batch in enumerate(loader):
        if index >= num_steps:
            return
        yield batch


_runner: Runner | None = None
# With TorchTrainer(use_local=True): (rank, world size) in the trainer's process group, which
# differs from the worker context's (rank 0 is the driver); None: the context's.
_placement: tuple[int, int] | None = None


def set_placement(rank: int, world_size: int) -> None:
    global _placement
    _placement = (rank, world_size)


def join_local_group(port: int, timeout_s: float) -> None:
    """A worker of a ``use_local=True`` trainer joins the gloo group of the driver (rank 0)
    and the other workers, as rank ``its own + 1``, through the driver's store on loopback."""
    import datetime

    import torch.distributed as dist

    context = get_context()
    rank, world_size = context.get_world_rank() + 1, context.get_world_size() + 1
    join = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=join)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=join)
    set_placement(rank, world_size)


def _current() -> Runner:
    if _runner is None:
        raise RuntimeError("This worker has no TrainingOperator (its TorchTrainer was shut down).")
    return _runner


# ----------------------------------------------------------------- called by the driver
def setup(
    operator_cls: type[TrainingOperator],
    config: dict[str, Any],
    options: dict[str, Any],
    initialization_hook: Callable[[], Any] | None,
    state: dict[str, Any] | bytes | None,
) -> None:
    """Run the initialization hook, build this worker's operator, and load ``state`` (a state
    dict, or one pickled by :func:`train`) if given."""
    global _runner
    _runner = None
    if initialization_hook is not None:
        initialization_hook()
    if _placement is not None:  # use_local=True: one machine, CPU only
        rank, world_size = _placement
        runner = Runner(operator_cls, config, options, rank, rank, world_size, torch.device("cpu"))
    else:
        context = get_context()
        device = get_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        runner = Runner(
            operator_cls,
            config,
            options,
            context.get_world_rank(),
            context.get_local_rank(),
            context.get_world_size(),
            device,
        )
    if state is not None:
        runner.load_state_dict(cloudpickle.loads(state) if isinstance(state, bytes) else state)
    _runner = runner


def train(num_steps: int | None, profile: bool, info: dict[str, Any] | None, keep_state: bool) -> tuple[Any, Any]:
    """One ``train()``: this worker's stats, and (rank 0 with ``keep_state``) the state after
    it, pickled here: the driver keeps the bytes and unpickles them only to restart."""
    runner = _current()
    stats = runner.train_epoch(num_steps, profile, info)
    state = None
    if keep_state and runner.operator.world_rank == 0:
        state = cloudpickle.dumps(runner.state_dict())
    return stats, state


def validate(num_steps: int | None, profile: bool, info: dict[str, Any] | None) -> dict[str, Any]:
    return _current().validate(num_steps, profile, info)


def state_dict() -> dict[str, Any]:
    return _current().state_dict()


def load_state_dict(state: dict[str, Any] | bytes) -> None:
    """Load a state dict, or one pickled by the driver (``TorchTrainer.load_state_dict``)."""
    _current().load_state_dict(cloudpickle.loads(state) if isinstance(state, bytes) else state)


def get_models(to_cpu: bool) -> list[torch.nn.Module]:
    models = _current().operator._get_original_models()
    if to_cpu:
        models = [copy.deepcopy(model).cpu() for model in models]
    return models


def apply_operator(fn: Callable[[TrainingOperator], Any]) -> Any:
    return fn(_current().operator)


def update_scheduler(metric: Any) -> None:
    for scheduler in _current().operator._schedulers:
        scheduler.step(metric)


def teardown() -> None:
    global _runner, _placement
    _runner = None
    _placement = None
