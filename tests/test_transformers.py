"""ddptrain.huggingface.transformers and accelerate: real libraries in real worker processes over gloo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from example_runner import run_example_in_process  # noqa: E402

import ddptrain as train  # noqa: E402
from ddptrain.huggingface.transformers import RayTrainReportCallback, prepare_trainer  # noqa: E402
from ddptrain.torch import TorchTrainer  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _tiny_bert() -> Any:
    config = transformers.BertConfig(
        vocab_size=128,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=2,
    )
    torch.manual_seed(train.get_context().get_world_rank())  # DDP must make the ranks agree
    return transformers.BertForSequenceClassification(config)


def _dataset() -> train.data.Dataset:
    """64 rows of 16 token ids; the first token is the row's index, to see who read which row."""
    ids = np.random.default_rng(0).integers(5, 128, size=(64, 16))
    ids[:, 0] = np.arange(64)
    return train.data.from_numpy({"input_ids": ids, "labels": (ids[:, 1] > 64).astype(np.int64)})


def _train_func(config: dict[str, Any]) -> dict[str, Any]:
    """Two epochs of 4 steps per worker: 32 rows of the shard in batches of 8."""
    seen: dict[str, Any] = {"rows": []}
    first_attempt = train.get_checkpoint() is None

    class Recording(transformers.Trainer):
        def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            seen["rows"].append(inputs["input_ids"][:, 0].tolist())
            return super().training_step(model, inputs, *args, **kwargs)

    class Probe(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen["start_step"] = state.global_step

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if first_attempt and state.global_step == config.get("crash_at_step") and args.process_index == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    args = transformers.TrainingArguments(
        output_dir=config["output_dir"],
        per_device_train_batch_size=8,
        max_steps=8,
        save_strategy="epoch",
        logging_strategy="epoch",
        learning_rate=1e-3,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Recording(
        model=_tiny_bert(), args=args, train_dataset=train.get_dataset_shard("train"), callbacks=[Probe()]
    )
    trainer.add_callback(RayTrainReportCallback())
    trainer = prepare_trainer(trainer)
    checkpoint = train.get_checkpoint()
    resume = os.path.join(checkpoint.path, RayTrainReportCallback.CHECKPOINT_NAME) if checkpoint else None
    trainer.train(resume_from_checkpoint=resume)
    seen["world_size"] = args.world_size
    seen["device"] = str(args.device)
    seen["param_devices"] = sorted({str(p.device) for p in trainer.model.parameters()})
    seen["global_step"] = trainer.state.global_step
    seen["weights"] = [p.detach().clone() for p in trainer.model.parameters()]
    return seen


def _fit(storage: str, tmp_path: Path, scaling: train.ScalingConfig | None = None, **config: Any) -> train.Result:
    return TorchTrainer(
        _train_func,
        train_loop_config={"output_dir": str(tmp_path / "hf_output"), **config},
        datasets={"train": _dataset()},
        scaling_config=scaling or train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage, failure_config=train.FailureConfig(max_failures=1)),
    ).fit()


@pytest.fixture
def accelerate_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # What ddptrain will set for use_gpu=False workers (see test_accelerate_multi_cpu_without_settings).
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")


@pytest.mark.slow
@pytest.mark.usefixtures("accelerate_on_cpu")
def test_steps_sharding_restart_resumes_step_count_and_checkpoint_loads(storage: str, tmp_path: Path) -> None:
    result = _fit(storage, tmp_path, crash_at_step=5)  # rank 1 dies in the second epoch
    rank0, rank1 = result.return_values
    assert rank0["world_size"] == rank1["world_size"] == 2
    # 4 steps per epoch: 32 rows per worker in batches of 8. Resumed from the step-4 checkpoint.
    assert [(m["step"], m["epoch"]) for m in result.metrics_history] == [(4, 1.0), (8, 2.0)]
    assert rank0["start_step"] == rank1["start_step"] == 4
    assert rank0["global_step"] == rank1["global_step"] == 8
    # Only the second epoch ran again; each rank read its own half of the rows, not split again.
    assert len(rank0["rows"]) == len(rank1["rows"]) == 4
    rows0 = [r for batch in rank0["rows"] for r in batch]
    rows1 = [r for batch in rank1["rows"] for r in batch]
    assert sorted(rows0 + rows1) == list(range(64))
    assert all(torch.equal(a, b) for a, b in zip(rank0["weights"], rank1["weights"]))
    assert isinstance(result.metrics["loss"], float)
    with result.checkpoint.as_directory() as d:
        loaded = transformers.BertForSequenceClassification.from_pretrained(
            os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME)
        )
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), rank0["weights"]))


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
def test_hf_trainer_on_gpus_trains_on_each_workers_device_and_resumes(storage: str, tmp_path: Path) -> None:
    # Two workers: a GPU each where there are 2, else half of GPU 0 each. accelerate must put
    # each rank's model (and its DDP wrapper) on ddptrain's device for it, not on cuda:LOCAL_RANK.
    halves = _gpus() < 2
    scaling = train.ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"GPU": 0.5} if halves else None)
    result = _fit(storage, tmp_path, scaling=scaling, crash_at_step=5)
    rank0, rank1 = result.return_values
    devices = ["cuda:0", "cuda:0"] if halves else ["cuda:0", "cuda:1"]
    assert [rank0["device"], rank1["device"]] == devices
    assert [rank0["param_devices"], rank1["param_devices"]] == [[d] for d in devices]
    assert rank0["world_size"] == 2 and rank0["start_step"] == 4 and rank0["global_step"] == 8
    assert all(torch.equal(a, b) for a, b in zip(rank0["weights"], rank1["weights"]))


def _accelerate_func() -> dict[str, Any]:
    from accelerate import Accelerator

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(torch.nn.Linear(2, 1), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]))
    return {"num_processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type)}


def test_accelerate_multi_cpu_without_settings(storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("accelerate")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    result = TorchTrainer(
        _accelerate_func,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    assert [v["num_processes"] for v in result.return_values] == [2, 2]
    assert "MULTI_CPU" in result.return_values[0]["distributed_type"]


def _hf_alone_func() -> list[str]:
    import warnings

    args = transformers.TrainingArguments(output_dir="unused", report_to=[], max_steps=1)
    trainer = transformers.Trainer(model=torch.nn.Linear(2, 2), args=args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_trainer(trainer)
    return [str(w.message) for w in caught]


def test_prepare_trainer_warns_when_each_cpu_worker_would_train_alone(
    storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCELERATE_USE_CPU", "0")  # the user's choice wins over ddptrain's default
    result = TorchTrainer(
        _hf_alone_func,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    for caught in result.return_values:
        assert any(
            "sees 1 process(es) but ddptrain runs 2 workers" in m and "ACCELERATE_USE_CPU=1" in m for m in caught
        )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("accelerate_on_cpu")
def test_example_transformers_tiny_bert(
    storage: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # The example's main() in this process: the workers are what it is about (a script driver
    # would add its own torch import and fork server).
    out = run_example_in_process(
        "transformers_tiny_bert.py", "--epochs", "1", "--storage-path", storage, monkeypatch=monkeypatch, capfd=capfd
    )
    assert "steps reported: [8]" in out  # 256 rows / 2 workers / batch 16
    assert "loaded BertForSequenceClassification from" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_accelerate_merges_every_rank_state(
    storage: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    out = run_example_in_process(
        "transformers_accelerate.py", "--epochs", "1", "--storage-path", storage, monkeypatch=monkeypatch, capfd=capfd
    )
    assert "[rank0] 2 processes (DistributedType.MULTI_CPU)" in out
    assert "'random_states_0.pkl', 'random_states_1.pkl'" in out  # both ranks' files, one checkpoint
    assert "'model.safetensors'" in out


def _ray_imports(source: str) -> str:
    """The example as Ray 2.6's docs wrote it: Ray's import paths."""
    ray = (
        source.replace("from ddptrain.huggingface import", "from ray.train.huggingface import")
        .replace("from ddptrain import RunConfig, ScalingConfig", "from ray.air.config import RunConfig, ScalingConfig")
        .replace("ddptrain.data", "ray.data")
    )
    assert "import ddptrain" not in ray and "from ddptrain" not in ray
    return ray


def _load_example(name: str) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_transformers_trainer_example_under_ddptrain_run_and_resume(storage: str, tmp_path: Path) -> None:
    from ddptrain.huggingface import TransformersTrainer

    script = tmp_path / "transformers_trainer.py"
    script.write_text(_ray_imports((EXAMPLES / "transformers_trainer.py").read_text()))
    proc = subprocess.run(
        [sys.executable, "-m", "ddptrain", "run", str(script), "--epochs", "2", "--storage-path", storage],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 128 rows, 2 workers, batch 8: each worker read its 64 rows, 8 steps an epoch; a report per save.
    assert "steps reported: [8, 16]" in proc.stdout
    assert "loaded GPT2LMHeadModel from" in proc.stdout
    first, last = (float(v) for v in proc.stdout.split("eval_loss: first ")[1].split("\n")[0].split(", last "))
    assert last < first
    # resume_from_checkpoint: the step-16 state goes on with epoch 3, here in this process on 64
    # rows (8 steps an epoch, as each worker had).
    (run,) = Path(storage).iterdir()
    checkpoint = sorted(run.glob("checkpoint_*"))[-1]
    example = _load_example("transformers_trainer")
    blocks, held_out = example.synthetic_blocks(64, seed=0), example.synthetic_blocks(16, seed=1)
    resumed = TransformersTrainer(
        example.trainer_init_per_worker,
        trainer_init_config={"output_dir": str(tmp_path / "out"), "epochs": 3},
        scaling_config=train.ScalingConfig(num_workers=0),
        run_config=train.RunConfig(storage_path=storage, name="resumed"),
        datasets={
            "train": train.data.from_numpy({"input_ids": blocks, "labels": blocks}),
            "evaluation": train.data.from_numpy({"input_ids": held_out, "labels": held_out}),
        },
        resume_from_checkpoint=train.Checkpoint(checkpoint),
    ).fit()
    assert [(m["step"], m["epoch"]) for m in resumed.metrics_history] == [(24, 3.0)]


def test_transformers_trainer_argument_errors() -> None:
    from ddptrain.huggingface import TransformersTrainer
    from ddptrain.huggingface import transformers as hf

    assert hf.TransformersTrainer is TransformersTrainer  # Ray had it under both paths
    with pytest.raises(train.errors.ConfigError, match=r"must take \(train_dataset, eval_dataset, \*\*config\)"):
        TransformersTrainer(lambda train_dataset, eval_dataset: None)
    with pytest.raises(train.errors.ConfigError, match="reserved key"):
        TransformersTrainer(lambda a, b, **c: None, trainer_init_config={"_trainer_init_per_worker": 1})
    trainer = TransformersTrainer(lambda a, b, **c: None, trainer_init_config={"lr": 1})
    assert isinstance(trainer, train.BaseTrainer) and isinstance(trainer, TorchTrainer)
