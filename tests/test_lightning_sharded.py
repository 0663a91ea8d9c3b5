"""Sharded Lightning checkpoints on CPU: every rank's shard reaches the checkpoint, also from a
host that does not share the driver's file systems.

Lightning's FSDP (FSDP1) and DeepSpeed strategies need CUDA. ``RayModelParallelStrategy``
(Lightning's ``ModelParallelStrategy``) shards with FSDP2 (``fully_shard``), which runs on gloo,
and saves a distributed checkpoint: one ``__<rank>_0.distcp`` file per rank plus rank 0's
metadata. Lightning broadcasts rank 0's folder for saving and loading, in its FSDP and DeepSpeed
strategies too; the ddptrain strategies keep each rank's own folder, which is what this tests.
"""

from __future__ import annotations

import glob
import os
import signal
import tempfile
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import ddptrain as train  # noqa: E402
from ddptrain.lightning import (  # noqa: E402
    RayLightningEnvironment,
    RayModelParallelStrategy,
    RayTrainReportCallback,
    prepare_trainer,
)
from ddptrain.torch import TorchTrainer  # noqa: E402


class ShardedModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, on_step=False, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _train_sharded(config: dict[str, Any]) -> dict[str, Any]:
    """Two epochs of 4 steps; rank 1 dies as epoch 1 starts (first attempt only)."""
    if os.path.isdir(config["tmp"]):  # the driver's machine: temp folders where the test can list them
        tempfile.tempdir = config["tmp"]

    first_attempt = train.get_checkpoint() is None
    seen: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            seen["sampler"] = dict(trainer.strategy.distributed_sampler_kwargs)
            seen["root_device"] = str(trainer.strategy.root_device)

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            seen.setdefault("start_epoch", trainer.current_epoch)
            if first_attempt and trainer.current_epoch == 1 and trainer.global_rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    loader: Any = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
    trainer = prepare_trainer(
        pl.Trainer(
            max_epochs=2,
            accelerator="cpu",
            strategy=RayModelParallelStrategy(),  # "auto": one worker per host, so 2-way data parallel
            plugins=[RayLightningEnvironment()],
            callbacks=[RayTrainReportCallback(), Probe()],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            logger=False,
        )
    )
    checkpoint = train.get_checkpoint()
    ckpt_path = os.path.join(checkpoint.path, RayTrainReportCallback.CHECKPOINT_NAME) if checkpoint else None
    model = ShardedModel()
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    seen["global_step"] = trainer.global_step
    seen["weights"] = [p.full_tensor().detach().clone() for p in model.parameters()]
    # What the callback left in the folders it wrote checkpoints into, on this worker's host.
    seen["left"] = glob.glob(os.path.join(config["tmp"], "ddptrain_lightning_*"))
    return seen


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sharded_checkpoint_keeps_every_ranks_shard_from_a_host_without_shared_storage(
    ssh, isolated: tuple[str, str]
) -> None:
    storage, iso = isolated
    tmp = os.path.join(storage, "tmp")  # a folder the isolated host does not have
    os.mkdir(tmp)
    result = TorchTrainer(
        _train_sharded,
        train_loop_config={"tmp": tmp},
        scaling_config=train.ScalingConfig(num_workers=2, hosts=["localhost slots=1", f"{iso} slots=1"]),
        run_config=train.RunConfig(
            name="sharded", storage_path=storage, failure_config=train.FailureConfig(max_failures=1)
        ),
    ).fit()
    rank0, rank1 = result.return_values
    assert rank0["root_device"] == rank1["root_device"] == "cpu"
    assert [rank0["sampler"], rank1["sampler"]] == [{"num_replicas": 2, "rank": 0}, {"num_replicas": 2, "rank": 1}]
    # Both ranks' shards (rank 1's written on the other host) and rank 0's metadata were kept.
    folder = os.path.join(result.checkpoint.path, RayTrainReportCallback.CHECKPOINT_NAME)
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    # The restart resumed from the sharded checkpoint of epoch 0 and went on counting.
    assert rank0["start_epoch"] == rank1["start_epoch"] == 1
    assert [(m["epoch"], m["step"]) for m in result.metrics_history] == [(0, 4), (1, 8)]
    assert rank0["global_step"] == rank1["global_step"] == 8
    assert all(torch.equal(a, b) for a, b in zip(rank0["weights"], rank1["weights"]))
    assert rank0["left"] == rank1["left"] == []
    assert os.listdir(tmp) == []


def test_model_parallel_auto_sizes_follow_the_hosts() -> None:
    from ddptrain.errors import ConfigError
    from ddptrain.lightning._impl import mesh_sizes

    assert mesh_sizes("auto", "auto", world=4, local=2) == (2, 2)  # 2 hosts of 2: TP in a host, DP across
    assert mesh_sizes("auto", "auto", world=2, local=1) == (2, 1)
    assert mesh_sizes("auto", 1, world=4, local=4) == (4, 1)
    assert mesh_sizes(1, "auto", world=4, local=2) == (1, 4)
    assert mesh_sizes(2, 3, world=4, local=2) == (2, 3)  # Lightning names the wrong product itself
    with pytest.raises(ConfigError, match="3 workers do not split into hosts of 2"):
        mesh_sizes("auto", "auto", world=3, local=2)
    with pytest.raises(ConfigError, match="not a multiple of tensor_parallel_size=3"):
        mesh_sizes("auto", 3, world=4, local=2)
