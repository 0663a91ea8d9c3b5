"""ddptrain.lightning: real Lightning (both packages) in real worker processes over gloo."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("pytorch_lightning")

from example_runner import run_example_in_process  # noqa: E402

import ddptrain as train  # noqa: E402
from ddptrain.lightning import (  # noqa: E402
    PackageMismatchError,
    RayDDPStrategy,
    RayDeepSpeedStrategy,
    RayFSDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    prepare_trainer,
)
from ddptrain.torch import TorchTrainer  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
_MODULES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
_model_classes: dict[str, Any] = {}


def _model_class(package: str) -> Any:
    """A tiny LightningModule on ``package`` (one class per package, kept for load_from_checkpoint)."""
    if package not in _model_classes:
        pl = importlib.import_module(_MODULES[package])

        class TinyModel(pl.LightningModule):
            def __init__(self, lr: float = 0.1) -> None:
                super().__init__()
                self.save_hyperparameters()
                self.layer = torch.nn.Linear(4, 2)

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                x, y = batch
                loss = torch.nn.functional.cross_entropy(self.layer(x), y)
                self.log("train_loss", loss, on_epoch=True, on_step=False, sync_dist=True)
                return loss

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        _model_classes[package] = TinyModel
    return _model_classes[package]


_STRATEGIES = {"ddp": RayDDPStrategy, "fsdp": RayFSDPStrategy, "deepspeed": RayDeepSpeedStrategy}


def _train_func(config: dict[str, Any]) -> dict[str, Any]:
    """A Ray-style Lightning loop; 64 rows, batch 8: 4 steps per epoch on each of 2 workers."""
    pl = importlib.import_module(_MODULES[config["package"]])  # the only package this frame uses
    first_attempt = train.get_checkpoint() is None
    seen: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            seen["start_epoch"] = trainer.current_epoch
            seen["sampler"] = dict(trainer.strategy.distributed_sampler_kwargs)
            seen["root_device"] = str(trainer.strategy.root_device)

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            if first_attempt and trainer.current_epoch == config.get("crash_at") and trainer.global_rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(train.get_context().get_world_rank())  # DDP must make the ranks agree
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    loader: Any = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
    if config.get("shard"):  # this worker's rows of the trainer's dataset, as Ray's docs feed Lightning
        loader = train.get_dataset_shard("train").iter_torch_batches(
            batch_size=8, collate_fn=lambda b: (torch.as_tensor(b["x"]), torch.as_tensor(b["y"]))
        )
    trainer = pl.Trainer(
        max_epochs=config["epochs"],
        devices="auto",  # one CPU device per process: the IndexError of plain DDPStrategy on rank 1
        accelerator="auto",
        strategy=_STRATEGIES[config.get("strategy", "ddp")](),
        plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback(**config.get("report", {})), Probe()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer = prepare_trainer(trainer)
    checkpoint = train.get_checkpoint()
    ckpt_path = os.path.join(checkpoint.path, RayTrainReportCallback.CHECKPOINT_NAME) if checkpoint else None
    model = _model_class(config["package"])()
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    seen["weights"] = [p.detach().cpu().clone() for p in model.parameters()]
    seen["global_step"] = trainer.global_step
    return seen


def _fit(storage: str, use_gpu: bool = False, gpus_per_worker: float | None = None, **config: Any) -> train.Result:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)).numpy()
    resources = None if gpus_per_worker is None else {"GPU": gpus_per_worker}
    return TorchTrainer(
        _train_func,
        train_loop_config=config,
        datasets={"train": train.data.from_numpy({"x": x, "y": (x[:, 0] > 0).astype("int64")})},
        scaling_config=train.ScalingConfig(num_workers=2, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=train.RunConfig(storage_path=storage, failure_config=train.FailureConfig(max_failures=1)),
    ).fit()


@pytest.mark.slow
def test_ddp_restart_after_worker_kill_resumes_with_equal_weights_and_loadable_checkpoint(storage: str) -> None:
    # Checkpoints every 2nd epoch and at the last: epoch 1 and 2; rank 1 dies as epoch 2 starts.
    result = _fit(storage, package="lightning", epochs=3, crash_at=2, report={"frequency": 2})
    rank0, rank1 = result.return_values
    # devices="auto" gave each worker its device (plain DDPStrategy fails on rank 1 here).
    assert rank0["root_device"] == rank1["root_device"] == "cpu"
    assert [rank0["sampler"], rank1["sampler"]] == [{"num_replicas": 2, "rank": 0}, {"num_replicas": 2, "rank": 1}]
    # Gradients were averaged: the ranks started from different seeds and end equal.
    assert all(torch.equal(a, b) for a, b in zip(rank0["weights"], rank1["weights"]))
    # Attempt 0 reported epochs 0 (metrics only) and 1 (a checkpoint); attempt 1 resumed at epoch 2.
    assert rank0["start_epoch"] == 2
    assert [(m["epoch"], m["step"]) for m in result.metrics_history] == [(0, 4), (1, 8), (2, 12)]
    assert [metrics["epoch"] for _, metrics in result.best_checkpoints] == [1, 2]
    assert rank0["global_step"] == 12  # 3 epochs x (64 rows / 2 ranks / batch 8)
    assert isinstance(result.metrics["train_loss"], float)
    assert sorted(os.listdir(result.checkpoint.path)) == [RayTrainReportCallback.CHECKPOINT_NAME]
    with result.checkpoint.as_directory() as d:
        model = _model_class("lightning").load_from_checkpoint(os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), rank0["weights"]))
    assert model.hparams.lr == 0.1


def test_pytorch_lightning_package_dataset_shard_and_checkpoints_every_n_steps(storage: str) -> None:
    result = _fit(
        storage, package="pytorch_lightning", epochs=2, shard=True, report={"frequency": 3, "frequency_unit": "step"}
    )
    # 32 rows of the shard per worker in batches of 8: Lightning did not split the shard again.
    assert [r["global_step"] for r in result.return_values] == [8, 8]
    assert [(m["epoch"], m["step"]) for m in result.metrics_history] == [(0, 3), (1, 6)]
    assert [metrics["step"] for _, metrics in result.best_checkpoints] == [3, 6]
    with result.checkpoint.as_directory() as d:
        model = _model_class("pytorch_lightning").load_from_checkpoint(
            os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME)
        )
    assert type(model).__mro__[1].__module__.startswith("pytorch_lightning")


def _mixed_packages() -> list[Any]:
    """Runs in local mode (``num_workers=0``): a frame that uses both packages."""
    import lightning.pytorch as pl  # noqa: F401
    import pytorch_lightning as ptl

    from ddptrain.lightning import lightning as for_lightning
    from ddptrain.lightning import pytorch_lightning as for_ptl

    errors: list[Any] = []
    try:
        RayDDPStrategy()
    except PackageMismatchError as e:
        errors.append(str(e))
    trainer = ptl.Trainer(
        strategy=for_ptl.RayDDPStrategy(),
        plugins=[for_ptl.RayLightningEnvironment()],
        callbacks=[for_lightning.RayTrainReportCallback()],
        logger=False,
        enable_progress_bar=False,
    )
    try:
        prepare_trainer(trainer)
    except PackageMismatchError as e:
        errors.append(str(e))
    ok = ptl.Trainer(strategy=for_ptl.RayDDPStrategy(), plugins=[for_ptl.RayLightningEnvironment()], logger=False)
    errors.append(prepare_trainer(ok) is ok)
    try:
        prepare_trainer(ptl.Trainer(strategy="ddp", logger=False))
    except RuntimeError as e:
        errors.append(str(e))
    return errors


def test_mixing_lightning_packages_fails_with_one_clear_error(storage: str) -> None:
    result = TorchTrainer(
        _mixed_packages,
        scaling_config=train.ScalingConfig(num_workers=0),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    ambiguous, mixed, ok, not_ray = result.return_value
    assert "`lightning`" in ambiguous and "`pytorch_lightning`" in ambiguous
    assert "from ddptrain.lightning.pytorch_lightning import RayDDPStrategy" in ambiguous
    assert "Trainer comes from `pytorch_lightning`" in mixed and "`lightning.pytorch`" in mixed
    assert ok is True
    assert "use `strategy=RayDDPStrategy()`" in not_ray


def _resume_warnings() -> list[list[str]]:
    """Runs in local mode, resumed from a checkpoint: what fit would warn for each ckpt_path."""
    import warnings

    import lightning.pytorch as pl

    trainer = pl.Trainer(
        strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()], logger=False, enable_progress_bar=False
    )
    trainer = prepare_trainer(trainer)
    good = os.path.join(train.get_checkpoint().path, RayTrainReportCallback.CHECKPOINT_NAME)
    found = []
    for ckpt_path in (None, "/elsewhere/epoch=0.ckpt", good):
        trainer.ckpt_path = ckpt_path
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for callback in trainer.callbacks:
                callback.on_train_start(trainer, None)
        found.append([str(w.message) for w in caught if "resumed from" in str(w.message)])
    return found


def test_prepare_trainer_warns_when_fit_would_not_resume_from_the_run_checkpoint(storage: str, tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    result = TorchTrainer(
        _resume_warnings,
        scaling_config=train.ScalingConfig(num_workers=0),
        run_config=train.RunConfig(storage_path=storage),
        resume_from_checkpoint=train.Checkpoint(tmp_path / "ckpt"),
    ).fit()
    missing, elsewhere, right = result.return_value
    expected = str(tmp_path / "ckpt" / RayTrainReportCallback.CHECKPOINT_NAME)
    assert len(missing) == 1 and "got no `ckpt_path`" in missing[0] and expected in missing[0]
    assert len(elsewhere) == 1 and "ckpt_path='/elsewhere/epoch=0.ckpt'" in elsewhere[0] and expected in elsewhere[0]
    assert right == []


def test_strategy_warns_about_arguments_the_process_group_ignores() -> None:
    from ddptrain.lightning.lightning import RayDDPStrategy as LightningRayDDPStrategy

    with pytest.warns(UserWarning, match="process_group_backend='nccl'.*TorchConfig"):
        LightningRayDDPStrategy(process_group_backend="nccl")


def test_import_ddptrain_imports_no_framework_and_a_missing_framework_names_the_extra() -> None:
    code = textwrap.dedent(
        """
        import sys
        import ddptrain, ddptrain.torch
        loaded = [m for m in ("lightning", "pytorch_lightning", "transformers", "accelerate") if m in sys.modules]
        print("loaded:", loaded)
        sys.modules["lightning"] = None
        sys.modules["pytorch_lightning"] = None
        try:
            import ddptrain.lightning
        except ImportError as e:
            print("error:", e)
        sys.modules["transformers"] = None
        try:
            import ddptrain.huggingface.transformers
        except ImportError as e:
            print("error:", e)
        from ddptrain.huggingface import TransformersTrainer  # importable; constructing it is not
        try:
            TransformersTrainer(lambda train_dataset, eval_dataset, **config: None)
        except ImportError as e:
            print("construction:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "loaded: []" in out.stdout
    assert "pip install ddptrain[lightning]" in out.stdout
    assert "pip install ddptrain[transformers]" in out.stdout
    assert "construction: TransformersTrainer needs Hugging Face Transformers" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_lightning_classifier_pytorch_lightning_with_a_crash(
    storage: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # The example's main() in this process, which has Lightning imported already (a script
    # driver would import torch, pytorch_lightning and start a fork server of its own first).
    out = run_example_in_process(
        "lightning_classifier.py",
        *("--package", "pytorch_lightning", "--epochs", "2", "--crash-at", "1", "--storage-path", storage),
        monkeypatch=monkeypatch,
        capfd=capfd,
    )
    assert "[rank0] attempt starts at epoch 0" in out
    assert "[rank0] attempt starts at epoch 1" in out
    assert "epochs reported: [0, 1]" in out
    assert "loaded Classifier (pytorch_lightning) from" in out


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_sharded_strategies_on_gpus(storage: str, strategy: str) -> None:
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    result = _fit(storage, use_gpu=True, package="lightning", epochs=1, strategy=strategy)
    assert [r["root_device"] for r in result.return_values] == ["cuda:0", "cuda:1"]
    assert result.return_values[0]["global_step"] == 4
    # FSDP: Lightning's full state dict, one file from rank 0; DeepSpeed: a folder of every rank's shards.
    assert os.path.exists(os.path.join(result.checkpoint.path, RayTrainReportCallback.CHECKPOINT_NAME))


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
def test_ddp_on_gpus_restarts_from_a_checkpoint_written_on_the_gpu(storage: str) -> None:
    # Two workers: a GPU each (nccl) where there are 2, else half of GPU 0 each (gloo). Rank 1
    # dies as epoch 1 starts; the restart loads the epoch-0 checkpoint saved from CUDA tensors.
    halves = _gpus() < 2
    share = 0.5 if halves else None
    result = _fit(storage, use_gpu=True, gpus_per_worker=share, package="lightning", epochs=2, crash_at=1)
    rank0, rank1 = result.return_values
    assert [rank0["root_device"], rank1["root_device"]] == (["cuda:0", "cuda:0"] if halves else ["cuda:0", "cuda:1"])
    assert rank0["start_epoch"] == 1 and rank0["global_step"] == 8
    assert all(torch.equal(a, b) for a, b in zip(rank0["weights"], rank1["weights"]))  # on the CPU here
    assert [m["epoch"] for m in result.metrics_history] == [0, 1]


@pytest.mark.skip(
    reason="FSDP needs an accelerator: torch's FullyShardedDataParallel refuses CPU-only devices "
    "('FSDP needs a non-CPU accelerator device'), so Lightning's FSDPStrategy cannot run on gloo/CPU"
)
def test_fsdp_on_cpu() -> None:
    pass


def _lightning_trainer_module(package: str) -> Any:
    """TinyModel with a validation loss, for LightningTrainer's ModelCheckpoint to monitor."""
    base = _model_class(package)

    class ValidatedModel(base):  # type: ignore[misc, valid-type]
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.layer(x), y), sync_dist=True)

    return ValidatedModel


def _crash_callback(package: str, crash_at: int) -> Any:
    pl = importlib.import_module(_MODULES[package])

    class CrashOnce(pl.Callback):
        """Says where each attempt starts; kills rank 1 at epoch ``crash_at`` of the first attempt."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.first_attempt = train.get_checkpoint() is None
            if trainer.global_rank == 0:
                print(f"attempt starts at epoch {trainer.current_epoch} step {trainer.global_step}", flush=True)

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            if self.first_attempt and trainer.current_epoch == crash_at and trainer.global_rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    return CrashOnce()


def _xy(batch: dict[str, Any]) -> tuple[Any, Any]:
    return torch.as_tensor(batch["x"]), torch.as_tensor(batch["y"])


@pytest.mark.slow
def test_lightning_trainer_shards_datasets_checkpoints_like_model_checkpoint_and_restarts(storage: str) -> None:
    from ddptrain.lightning import MODEL_KEY, LightningConfigBuilder, LightningTrainer

    x = torch.randn(96, 4, generator=torch.Generator().manual_seed(0)).numpy()
    rows = {"x": x, "y": (x[:, 0] > 0).astype("int64")}
    datasets = {
        "train": train.data.from_numpy({k: v[:64] for k, v in rows.items()}),
        "val": train.data.from_numpy({k: v[64:] for k, v in rows.items()}),
    }
    config = (
        LightningConfigBuilder()
        .module(cls=_lightning_trainer_module("lightning"), lr=0.2)
        .trainer(
            max_epochs=3,
            accelerator="cpu",
            callbacks=[_crash_callback("lightning", crash_at=2)],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        .checkpointing(monitor="val_loss", mode="min", save_top_k=2)
        .build()
    )
    trainer = LightningTrainer(
        lightning_config=config,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage, failure_config=train.FailureConfig(max_failures=1)),
        datasets=datasets,
        datasets_iter_config={"batch_size": 8, "collate_fn": _xy},
    )
    assert isinstance(trainer, train.BaseTrainer) and isinstance(trainer, TorchTrainer)
    result = trainer.fit()
    # Each worker read its 32 rows in batches of 8 (4 steps an epoch); ModelCheckpoint saved after
    # each validation, and each save was reported; rank 1 died as epoch 2 began, and the restarted
    # group resumed from the epoch-1 checkpoint.
    assert [(m["epoch"], m["step"]) for m in result.metrics_history] == [(0, 4), (1, 8), (2, 12)]
    assert {m["_report_on"] for m in result.metrics_history} <= {"train_epoch_end", "validation_end"}
    # The run kept Lightning's top 2 by val_loss (CheckpointConfig made from .checkpointing()).
    losses = sorted(m["val_loss"] for m in result.metrics_history)
    assert sorted(m["val_loss"] for _, m in result.best_checkpoints) == losses[:2]
    assert os.listdir(result.checkpoint.path) == [MODEL_KEY]
    model = _lightning_trainer_module("lightning").load_from_checkpoint(os.path.join(result.checkpoint.path, MODEL_KEY))
    assert model.hparams.lr == 0.2
    assert torch.load(os.path.join(result.checkpoint.path, MODEL_KEY), weights_only=False)["global_step"] == 12

    # resume_from_checkpoint: a new run (here in this process) continues at epoch 3.
    config["_trainer_init_config"]["max_epochs"] = 4
    resumed = LightningTrainer(
        lightning_config=config,
        scaling_config=train.ScalingConfig(num_workers=0),
        run_config=train.RunConfig(storage_path=storage),
        datasets=datasets,
        datasets_iter_config={"batch_size": 8, "collate_fn": _xy},
        resume_from_checkpoint=result.checkpoint,
    ).fit()
    assert [(m["epoch"], m["step"]) for m in resumed.metrics_history] == [(3, 20)]  # 8 steps: one worker, 64 rows


def test_lightning_config_builder_misuse_fails_at_construction_with_what_to_do() -> None:
    from ddptrain.lightning import LightningConfigBuilder, LightningTrainer

    module = _lightning_trainer_module("lightning")
    with pytest.raises(train.errors.ConfigError, match=r"call `.module\(cls=MyModule"):
        LightningTrainer(lightning_config=LightningConfigBuilder().trainer(max_epochs=1).build())
    with pytest.raises(train.errors.ConfigError, match="not an instance"):
        LightningConfigBuilder().module(cls=module()).build()
    with pytest.raises(train.errors.ConfigError, match="subclass of `LightningModule`"):
        LightningConfigBuilder().module(cls=torch.nn.Linear).build()
    with pytest.raises(train.errors.ConfigError, match="must be one of 'ddp', 'fsdp', 'deepspeed'"):
        LightningConfigBuilder().strategy("horovod")
    with pytest.raises(train.errors.ConfigError, match="not the LightningConfigBuilder itself"):
        LightningTrainer(lightning_config=LightningConfigBuilder().module(cls=module))
    config = LightningConfigBuilder().module(cls=module).checkpointing(save_top_k=-1).build()
    with pytest.raises(train.errors.ConfigError, match="needs `datasets_iter_config`"):
        LightningTrainer(lightning_config=config, datasets={"train": train.data.from_items([{"x": 1}])})
    trainer = LightningTrainer(lightning_config=config)
    # A sweep overrides the module's arguments with a partial config, as in Ray's docs.
    from ddptrain.tune.trainable import TrainerTrainable

    space = {"lightning_config": LightningConfigBuilder().module(lr=0.5).trainer(max_epochs=2).build()}
    prepared = TrainerTrainable(trainer).prepare(space).trainer
    assert prepared is not None and prepared.train_loop_config is not None
    tried = prepared.train_loop_config["lightning_config"]
    assert tried["_module_class"] is module and tried["_module_init_config"] == {"lr": 0.5}
    assert tried["_trainer_init_config"] == {"max_epochs": 2}
    assert trainer.run_config.checkpoint_config == train.CheckpointConfig(
        num_to_keep=None, checkpoint_score_order="min"
    )


def _ray_imports(source: str) -> str:
    """The example as Ray 2.6's docs wrote it: Ray's import paths."""
    ray = source.replace("from ddptrain.lightning import", "from ray.train.lightning import").replace(
        "from ddptrain import RunConfig, ScalingConfig", "from ray.air.config import RunConfig, ScalingConfig"
    )
    assert "import ddptrain" not in ray and "from ddptrain" not in ray
    return ray


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_trainer_example_under_ddptrain_run(storage: str, tmp_path: Path) -> None:
    script = tmp_path / "lightning_trainer.py"
    script.write_text(_ray_imports((EXAMPLES / "lightning_trainer.py").read_text()))
    proc = subprocess.run(
        [sys.executable, "-m", "ddptrain", "run", str(script), "--epochs", "2", "--storage-path", storage],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "epochs reported: [0, 1]" in proc.stdout
    assert "best checkpoints kept: 2" in proc.stdout
    assert "loaded MNISTClassifier (lr=0.001) from" in proc.stdout
