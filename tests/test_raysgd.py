"""RaySGD's TrainingOperator API (``ddptrain.util.sgd``): real worker processes, gloo, 2 workers,
tiny models. Each test shuts its trainers down (conftest fails a test that leaves a process)."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ddptrain import ConfigError, WorkerGroupError
from ddptrain.util.sgd import TorchTrainer, TrainingOperator
from ddptrain.util.sgd.utils import BATCH_SIZE, NUM_SAMPLES, AverageMeterCollection


def _linear_data(n: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, generator=generator)
    return TensorDataset(x, 2 * x + 1)


class UnevenOperator(TrainingOperator):
    """Rank 0 gets 4 samples, rank 1 gets 3 (batches of 2: [2, 2] and [2, 1]); each batch
    also reports ``m = 10 * rank + batch_idx``, so the averages can be computed by hand."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(self.world_rank)  # different initial weights: DDP must sync them
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=optimizer, criterion=nn.MSELoss()
        )
        data = _linear_data(4 - self.world_rank, seed=self.world_rank)
        self.register_data(
            train_loader=DataLoader(data, batch_size=2), validation_loader=DataLoader(data, batch_size=2)
        )

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        metrics = super().train_batch(batch, batch_info)
        metrics["m"] = 10 * self.world_rank + batch_info["batch_idx"]
        return metrics


def _params(op: TrainingOperator) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in op.model.parameters()]


def _pid() -> int:
    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:1]
    except OSError:
        return False


# DDP's first use in a process imports torch._dynamo: 5-8 s per worker on this 2-core machine.
@pytest.mark.slow
def test_train_syncs_the_workers_and_averages_metrics_by_samples() -> None:
    trainer = TorchTrainer(training_operator_cls=UnevenOperator, num_workers=2, use_gpu=False, add_dist_sampler=False)
    try:
        before = trainer.apply_all_operators(_params)
        stats = trainer.train()
        after = trainer.apply_all_operators(_params)
        # DDP averaged the gradients: both replicas hold the same, changed weights.
        assert after[0] == after[1] and after[0] != before[0]
        assert stats["epoch"] == 1 and stats[NUM_SAMPLES] == 7 and stats["batch_count"] == 2
        # m: rank 0 batches (0 x2, 1 x2) -> 0.5 over 4 samples; rank 1 (10 x2, 11 x1) -> 31/3 over 3.
        assert stats["m"] == pytest.approx((0.5 * 4 + 31 / 3 * 3) / 7)
        assert stats["last_m"] == pytest.approx((1 * 4 + 11 * 3) / 7)
        per_worker = trainer.train(reduce_results=False)
        assert [s[NUM_SAMPLES] for s in per_worker] == [4, 3] and [s["epoch"] for s in per_worker] == [2, 2]
        assert [s["m"] for s in per_worker] == [pytest.approx(0.5), pytest.approx(31 / 3)]
        losses = [s["train_loss"] for s in per_worker]
        assert trainer.train(num_steps=1)["batch_count"] == 1

        val = trainer.validate()
        assert set(val) >= {"num_samples", "batch_count", "val_loss", "last_val_loss", "val_accuracy"}
        assert val[NUM_SAMPLES] == 7 and math.isfinite(val["val_loss"])

        model = trainer.get_model()
        assert type(model) is nn.Linear  # unwrapped, in this process
        assert [p.detach().flatten().tolist() for p in model.parameters()] == trainer.apply_all_operators(_params)[0]
        local = trainer.get_local_operator()
        assert _params(local) == _params(trainer.get_local_operator()) == trainer.apply_all_operators(_params)[1]
        assert all(math.isfinite(loss) for loss in losses)
        pids = trainer.apply_all_workers(_pid)
        assert len(set(pids)) == 2 and os.getpid() not in pids
    finally:
        trainer.shutdown()
        trainer.shutdown()  # twice is fine
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="shut down"):
        trainer.train()


class SchedulerOperator(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        self.model, self.optimizer, self.criterion, self.scheduler = self.register(
            models=model, optimizers=optimizer, criterion=nn.MSELoss(), schedulers=scheduler
        )
        self.register_data(train_loader=DataLoader(_linear_data(16), batch_size=config[BATCH_SIZE], shuffle=True))
        self.seen = 0

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        self.seen += 1
        return {**super().train_batch(batch, batch_info), "lr": self.optimizer.param_groups[0]["lr"]}

    def state_dict(self) -> Any:
        return {"seen": self.seen}

    def load_state_dict(self, state: Any) -> None:
        self.seen = state["seen"]


def _lr(op: TrainingOperator) -> float:
    return float(op.optimizer.param_groups[0]["lr"])


@pytest.mark.slow
def test_save_then_load_into_a_new_trainer_restores_weights_and_the_scheduler(tmp_path: Path) -> None:
    config = {"lr": 0.4, BATCH_SIZE: 8}  # 4 per worker
    with TorchTrainer(
        training_operator_cls=SchedulerOperator,
        num_workers=2,
        config=config,
        scheduler_step_freq="epoch",
        wrap_ddp=False,
    ) as first:
        first.train()
        stats = first.train()
        assert stats["lr"] == pytest.approx(0.2)  # the scheduler stepped after epoch 1
        assert first.apply_all_operators(lambda op: op.config[BATCH_SIZE]) == [4, 4]
        path = first.save(tmp_path / "checkpoint.pt")
        weights = first.apply_all_operators(_params)[0]
    with TorchTrainer(
        training_operator_cls=SchedulerOperator,
        num_workers=2,
        config=config,
        scheduler_step_freq="epoch",
        wrap_ddp=False,
    ) as second:
        second.load(path)
        assert second.apply_all_operators(_params) == [weights, weights]
        assert second.apply_all_operators(_lr) == [pytest.approx(0.1)] * 2
        assert second.apply_all_operators(lambda op: op.seen) == [4, 4]  # the operator's own state
        stats = second.train()
        assert stats["epoch"] == 3 and stats["lr"] == pytest.approx(0.1)  # continues: 0.4, 0.2, 0.1
        assert second.apply_all_operators(_lr) == [pytest.approx(0.05)] * 2


class KilledOnceOperator(SchedulerOperator):
    """Rank 1 is SIGKILLed in the middle of the second epoch, once (a marker file says when)."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        marker = Path(self.config["marker"])
        if self.world_rank == 1 and batch_info["epoch_idx"] == 1 and batch_info["batch_idx"] == 1:
            if not marker.exists():
                marker.write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)
        return super().train_batch(batch, batch_info)


@pytest.mark.slow
def test_a_worker_killed_during_train_is_replaced_and_the_call_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "killed"
    config = {"lr": 0.4, BATCH_SIZE: 8, "marker": str(marker)}
    with TorchTrainer(
        training_operator_cls=KilledOnceOperator, num_workers=2, config=config, scheduler_step_freq="epoch"
    ) as trainer:
        first = trainer.train()
        pids = trainer.apply_all_workers(_pid)
        with caplog.at_level(logging.WARNING, logger="ddptrain.util.sgd.torch.torch_trainer"):
            stats = trainer.train()
        assert marker.exists()
        assert "a worker was lost during train()" in caplog.text
        # Resumed from the state after epoch 1: this is epoch 2, at the scheduler's second lr.
        assert first["epoch"] == 1 and stats["epoch"] == 2 and stats["lr"] == pytest.approx(0.2)
        assert stats[NUM_SAMPLES] == 16
        assert trainer.worker_count == 2
        assert not set(trainer.apply_all_workers(_pid)) & set(pids)
        weights = trainer.apply_all_operators(_params)
        assert weights[0] == weights[1]
        # A worker lost outside train(): that call raises (never hangs); the next call restarts
        # the workers from the state kept after the last train().
        with pytest.raises(WorkerGroupError):
            trainer.apply_all_workers(_kill_rank_1)
        assert trainer.state_dict()["epoch"] == 2 and trainer.worker_count == 2


def _kill_rank_1() -> None:
    import ddptrain

    if ddptrain.get_context().get_world_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)


class SetupFails(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        self.register(models=model, optimizers=optimizer, schedulers=scheduler)  # no scheduler_step_freq


class BatchFails(SchedulerOperator):
    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        if self.world_rank == 1:
            raise ValueError("bad batch in train_batch")
        return super().train_batch(batch, batch_info)


def _bad_model_creator(config: dict[str, Any]) -> nn.Module:
    raise RuntimeError("model_creator failed")


def test_bad_arguments_fail_in_the_constructor_before_any_worker_starts() -> None:
    with pytest.raises(ConfigError, match="scheduler_step_freq"):
        TorchTrainer(training_operator_cls=SetupFails, scheduler_step_freq="sometimes")
    with pytest.raises(ConfigError, match="TrainingOperator"):
        TorchTrainer(training_operator_cls=nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_workers"):
        TorchTrainer(training_operator_cls=SetupFails, num_workers=0)


def test_use_gpu_auto_counts_gpus_without_asking_cuda_in_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cuda.is_available() calls into CUDA (cuInit) in the driver, after which the processes
    # it forks cannot use CUDA: "auto" must count the GPUs as the rest of ddptrain does (NVML).
    # A tripwire, not a stand-in: the check under test runs for real, and this CPU build's count is 0.
    from ddptrain.util.sgd.torch._arguments import check_arguments

    def asked_cuda() -> bool:
        raise AssertionError("the driver called torch.cuda.is_available()")

    monkeypatch.setattr(torch.cuda, "is_available", asked_cuda)
    arguments = {"num_workers": 1, "scheduler_step_freq": None, "use_fp16": False, "apex_args": None, "config": None}
    use_gpu = check_arguments(training_operator_cls=UnevenOperator, use_gpu="auto", **arguments)
    assert use_gpu is (torch.cuda.device_count() > 0)


def test_an_error_in_setup_reaches_the_driver_with_the_workers_traceback() -> None:
    with pytest.raises(WorkerGroupError) as info:
        TorchTrainer(training_operator_cls=SetupFails, num_workers=2)  # a scheduler without scheduler_step_freq
    # Both ranks fail in setup; whichever fails first is the root cause (the other may be stopped first).
    assert info.value.worker_failures and all(isinstance(f, ConfigError) for f in info.value.worker_failures.values())
    assert "scheduler_step_freq" in str(info.value)
    assert "in setup" in info.value.failures[0].traceback_str


def test_an_error_in_a_creator_reaches_the_driver_with_the_workers_traceback() -> None:
    creators = TrainingOperator.from_creators(
        _bad_model_creator, lambda models, config: torch.optim.SGD(models.parameters(), lr=0.1)
    )
    with pytest.raises(WorkerGroupError, match="model_creator failed") as info:
        TorchTrainer(training_operator_cls=creators, num_workers=2)
    assert "_bad_model_creator" in info.value.failures[0].traceback_str


def test_an_error_in_train_batch_is_not_retried_and_carries_the_traceback() -> None:
    config = {"lr": 0.1, BATCH_SIZE: 8}
    trainer = TorchTrainer(
        training_operator_cls=BatchFails, num_workers=2, config=config, scheduler_step_freq="epoch", wrap_ddp=False
    )
    try:
        with pytest.raises(WorkerGroupError, match="bad batch in train_batch") as info:
            trainer.train(max_retries=3)  # an error of the operator: not retried
        failure = next(f for f in info.value.failures if f.rank == 1)
        assert "in train_batch" in failure.traceback_str and isinstance(failure.exception, ValueError)
        assert trainer.worker_count == 2  # no restart happened
    finally:
        trainer.shutdown()


def _model_creator(config: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(1, 1)


def _optimizer_creator(model: nn.Module, config: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=config["lr"])


def _data_creator(config: dict[str, Any]) -> tuple[DataLoader, DataLoader]:
    data = _linear_data(20)
    return DataLoader(data, batch_size=config[BATCH_SIZE]), DataLoader(data, batch_size=config[BATCH_SIZE])


def _scheduler_creator(optimizer: torch.optim.Optimizer, config: dict[str, Any]) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)


def _no_tqdm() -> None:
    sys.modules["tqdm"] = None  # type: ignore[assignment]  # as if tqdm were not installed


def test_from_creators_with_fp16_progress_lines_profile_and_batch_scheduler(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    operator = TrainingOperator.from_creators(
        _model_creator, _optimizer_creator, _data_creator, loss_creator=nn.MSELoss, scheduler_creator=_scheduler_creator
    )
    with caplog.at_level(logging.WARNING, logger="ddptrain.util.sgd.torch.torch_trainer"):
        trainer = TorchTrainer(
            training_operator_cls=operator,
            initialization_hook=_no_tqdm,
            num_workers=2,
            config={"lr": 0.1, BATCH_SIZE: 9},  # 4 per worker, with a warning
            use_fp16=True,
            use_tqdm=True,
            scheduler_step_freq="batch",
            wrap_ddp=False,  # DDP's first use imports torch._dynamo (5+ s): not what this test is about
        )
    try:
        assert "from 9 to 8" in caplog.text
        stats = trainer.train(profile=True)
        assert stats[NUM_SAMPLES] == 20 and stats["batch_count"] == 3  # 10 per worker, batches of 4
        assert set(stats["profile"]) == {"mean_fwd_s", "mean_grad_s", "mean_apply_s", "mean_train_epoch_s"}
        assert all(v >= 0 for v in stats["profile"].values())
        assert math.isfinite(stats["train_loss"]) and "profile" not in trainer.train()
        assert trainer.apply_all_operators(_lr) == [pytest.approx(0.1 * 0.9**6)] * 2  # stepped per batch
        assert trainer.apply_all_operators(lambda op: (op.use_fp16, op._amp_scaler is not None)) == [(True, True)] * 2
        assert "amp" in trainer.state_dict()
        assert math.isfinite(trainer.validate()["val_loss"])
    finally:
        trainer.shutdown()
    out = capfd.readouterr().out
    assert "[rank0] epoch 1e: batch 3/3 loss=" in out and "[rank1] epoch" not in out


def test_average_meter_collection_weights_batches_by_samples() -> None:
    meters = AverageMeterCollection()
    meters.update({"loss": 1.0, "acc": 0.5}, n=3)
    meters.update({"loss": 3.0, "acc": 1.0}, n=1)
    assert meters.summary() == {
        "batch_count": 2,
        "num_samples": 4,
        "loss": 1.5,
        "last_loss": 3.0,
        "acc": 0.625,
        "last_acc": 1.0,
    }


@pytest.mark.ssh
@pytest.mark.slow
def test_on_ssh_hosts_a_lost_host_leaves_fewer_workers_with_a_warning(ssh) -> None:
    spare = ssh.add_host("h9", "127.0.0.29")
    config = {"lr": 0.4, BATCH_SIZE: 8}
    with TorchTrainer(
        training_operator_cls=SchedulerOperator,
        num_workers=2,
        config=config,
        scheduler_step_freq="epoch",
        hosts=["h0 slots=1", "h9 slots=1"],
    ) as trainer:
        first = trainer.train()
        assert first[NUM_SAMPLES] == 16 and trainer.worker_count == 2
        weights = trainer.apply_all_operators(_params)
        assert weights[0] == weights[1]  # DDP across the two hosts
        ssh.remove_host(spare)  # the host goes away: its sshd, agent and worker are killed
        with pytest.warns(RuntimeWarning, match="only 1 of 2 workers"):
            stats = trainer.train()
        assert trainer.worker_count == 1
        assert stats["epoch"] == 2 and stats[NUM_SAMPLES] == 16 and stats["lr"] == pytest.approx(0.2)
        assert trainer.apply_all_operators(lambda op: op.config[BATCH_SIZE]) == [8]
        assert trainer.train()["epoch"] == 3


@pytest.mark.slow
def test_as_trainable_runs_a_sweep_with_ddptrain_tune(tmp_path: Path) -> None:
    from ddptrain import tune

    trainable = TorchTrainer.as_trainable(
        training_operator_cls=SchedulerOperator,
        num_workers=1,
        config={BATCH_SIZE: 8},
        scheduler_step_freq="epoch",
    )
    analysis = tune.run(
        trainable,
        config={"lr": tune.grid_search([0.0, 0.1])},
        stop={"training_iteration": 2},
        storage_path=str(tmp_path),
        max_concurrent_trials=1,
        verbose=0,
    )
    assert analysis.get_best_config(metric="train_loss", mode="min") == {"lr": 0.1}
    results = [trial.last_result for trial in analysis.trials]
    assert sorted(r["epoch"] for r in results) == [2, 2] and all(r["training_iteration"] == 2 for r in results)


class SerializedSetupOperator(TrainingOperator):
    """Times its data creation (before ``register``), then meets the other worker in a collective."""

    def setup(self, config: dict[str, Any]) -> None:
        start = time.time()
        time.sleep(0.5)  # "downloading the data set"
        self.window = (start, time.time())
        model = nn.Linear(1, 1)
        self.register(models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
        torch.distributed.barrier()  # register let the next worker in: no deadlock


@pytest.mark.slow
def test_serialize_data_creation_runs_setup_one_worker_at_a_time_until_register() -> None:
    with TorchTrainer(
        training_operator_cls=SerializedSetupOperator, num_workers=2, wrap_ddp=False, serialize_data_creation=True
    ) as trainer:
        first, second = sorted(trainer.apply_all_operators(lambda op: op.window))
    assert first[1] <= second[0], (first, second)


def test_nccl_timeout_s_sets_the_nccl_process_group_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU path cannot run here: this checks the value TorchTrainer gives TorchConfig(timeout_s=...),
    # which the workers pass to init_process_group.
    import importlib

    from ddptrain.util.sgd.torch import constants
    from ddptrain.util.sgd.torch.torch_trainer import process_group_timeout_s

    monkeypatch.delenv("NCCL_TIMEOUT_S", raising=False)
    assert process_group_timeout_s("nccl", True, 60) == 60
    monkeypatch.setenv("NCCL_TIMEOUT_S", "1000")
    assert process_group_timeout_s("nccl", True, 60) == 1000
    assert process_group_timeout_s("auto", True, 60) == 1000  # auto with GPUs is nccl
    assert process_group_timeout_s("auto", False, 60) == 60  # gloo: timeout_s
    assert process_group_timeout_s("gloo", True, 60) == 60
    assert importlib.reload(constants).NCCL_TIMEOUT_S == 1000
    monkeypatch.setenv("NCCL_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="`NCCL_TIMEOUT_S` must be a number of seconds, got 'soon'"):
        process_group_timeout_s("nccl", True, 60)
    monkeypatch.delenv("NCCL_TIMEOUT_S")
    assert importlib.reload(constants).NCCL_TIMEOUT_S == 1800


@pytest.mark.slow
def test_as_trainable_is_a_base_torch_trainable_class_that_tune_runs_saves_and_restores(tmp_path: Path) -> None:
    from ddptrain import tune
    from ddptrain.util.sgd.torch import BaseTorchTrainable

    TorchTrainable = TorchTrainer.as_trainable(
        training_operator_cls=SchedulerOperator,
        num_workers=1,
        config={BATCH_SIZE: 8},
        scheduler_step_freq="epoch",
        checkpoint_freq=1,
    )
    assert isinstance(TorchTrainable, type) and issubclass(TorchTrainable, BaseTorchTrainable)

    trainable = TorchTrainable({"lr": 0.1})  # Ray's Trainable(config): setup builds the trainer
    try:
        assert trainable.step()["epoch"] == 1 and "profile" in trainable.step()  # epoch 2
        path = trainable.save_checkpoint(str(tmp_path))
        trainable.step()
        trainable.load_checkpoint(path)
        assert trainable.step()["epoch"] == 3
    finally:
        trainable.cleanup()

    class TwoEpochsPerStep(TorchTrainable):  # Ray 1.x's way of customising an iteration
        def step(self) -> dict[str, Any]:
            self.trainer.train()
            return {**super().step(), "iterations_before": self.training_iteration}

    analysis = tune.run(
        TwoEpochsPerStep, config={"lr": 0.1}, stop={"training_iteration": 2}, storage_path=str(tmp_path), verbose=0
    )
    [trial] = analysis.trials
    result = trial.last_result
    assert result["epoch"] == 4 and result["training_iteration"] == 2 and result["iterations_before"] == 1
    assert trial.checkpoint is not None
    with trial.checkpoint.as_directory() as folder:
        assert sorted(os.listdir(folder)) == ["ddptrain_trainable.json", "trainer.checkpoint"]


@pytest.mark.slow
def test_use_local_runs_rank_0_in_the_driver_where_pdb_reads_the_terminal() -> None:
    script = Path(__file__).resolve().parent / "data" / "raysgd_use_local.py"
    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run(
        [sys.executable, str(script)],
        input="hello from the terminal\np answer\nc\n",  # a line for rank 0, then two pdb commands
        capture_output=True,
        text=True,
        timeout=120,  # before use_local worked, pdb waited in a worker for input that never came
        env={**os.environ, "PYTHONPATH": root},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    driver = int(out.split("driver pid ")[1].split()[0])
    rank0, rank1 = (int(p) for p in out.split("pids [")[1].split("]")[0].split(", "))
    assert rank0 == driver and rank1 != driver  # rank 0 in the driver, rank 1 in a worker
    assert "lines ['hello from the terminal', None]" in out  # rank 0 read the driver's stdin
    assert "(Pdb) 42" in out  # pdb in rank 0 got its commands from the driver's stdin
    assert "trained 8 ranks agree True" in out  # one gloo group: DDP kept the two ranks equal
    # rank 1 raised while rank 0 waited for it in DDP's all-reduce: the call fails at once
    seconds = int(out.split("failed after ")[1].split()[0])
    assert seconds < 30 and "s: True" in out, out


def test_use_local_refuses_gpus_and_hosts() -> None:
    with pytest.raises(ConfigError, match="cannot be combined with use_gpu=True or hosts"):
        TorchTrainer(training_operator_cls=SchedulerOperator, use_local=True, use_gpu=True)
