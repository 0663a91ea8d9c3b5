"""The one session builder (``context.build_session``) and the one report path: a worker's
session and local mode's differ only in their sink. No process: the sink here records."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ddptrain as train
from ddptrain import context
from ddptrain.checkpoint import Checkpoint
from ddptrain.wire import protocol


class _Recorder:
    def __init__(self) -> None:
        self.reports: list[tuple[int, dict[str, Any], Checkpoint | None, str | None]] = []

    def report(
        self,
        session: context._Session,
        metrics: dict[str, Any],
        checkpoint: Checkpoint | None,
        dir_name: str | None,
        upload: context.Upload,
        validation: bytes | None = None,
    ) -> None:
        self.reports.append((session.report_index, metrics, checkpoint, dir_name))
        if checkpoint is not None:
            session.checkpoint = Checkpoint(f"/committed/{dir_name}")

    def reported_checkpoints(self, session: context._Session, timeout_s: float | None, validated: bool) -> list[Any]:
        return [context.ReportedCheckpoint(Checkpoint("/committed/a"), {"n": session.report_index})]


def test_reports_go_to_the_sessions_sink(tmp_path) -> None:
    run = protocol.RunInfo(
        name="exp",
        storage=protocol.StorageSpec(kind="local", storage_path=str(tmp_path), run_dir=str(tmp_path / "exp")),
        attempt=2,
        report_index=5,
    )
    place = protocol.WorkerSpec(
        rank=3, local_rank=1, node_rank=1, world_size=4, local_world_size=2, devices=(0,), env={}
    )
    sink = _Recorder()
    start = Checkpoint(str(tmp_path / "start"))
    session = context.build_session(run, place, sink, dataset_shards={"train": [1, 2]}, checkpoint=start)
    context._set_session(session)
    try:
        ctx = train.get_context()
        assert (ctx.get_world_rank(), ctx.get_local_rank(), ctx.get_node_rank()) == (3, 1, 1)
        assert (ctx.get_world_size(), ctx.get_local_world_size(), ctx.get_experiment_name()) == (4, 2, "exp")
        assert session.devices == [0] and session.attempt == 2 and session.run_dir == str(tmp_path / "exp")
        assert train.get_checkpoint() is start and train.get_dataset_shard() == [1, 2]
        train.report({"loss": 1.0})
        train.report({"loss": 0.5}, checkpoint=Checkpoint(str(tmp_path)), checkpoint_dir_name="best")
        tensor = {"loss": torch.tensor(0.1)}
        with pytest.raises(ValueError, match="torch.Tensor"):
            train.report(tensor)
        assert [(index, metrics, name) for index, metrics, _, name in sink.reports] == [
            (6, {"loss": 1.0}, None),
            (7, {"loss": 0.5}, "best"),
        ]
        assert train.get_checkpoint().path == "/committed/best"
        (listed,) = train.get_all_reported_checkpoints()
        assert listed.metrics == {"n": 7}
    finally:
        context._set_session(None)
