"""SIGKILL at random moments, many times in one run, to any process the run started on its SSH
hosts (workers, agents, their shells and helpers): the run keeps going from its latest
checkpoint, finishes, loses no committed report and leaves nothing running."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ddptrain as train
from ddptrain._proc import stat_fields
from ddptrain.torch import TorchTrainer

EPOCHS = int(os.environ.get("EPOCHS", "20"))


def epochs_with_checkpoints(config: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        start = json.loads(Path(checkpoint.path, "state.json").read_text())["epoch"] + 1
    for epoch in range(start, EPOCHS):
        total = torch.ones(1)
        dist.all_reduce(total)
        time.sleep(0.4)
        folder = tempfile.mkdtemp()  # ASYNC deletes it once uploaded
        Path(folder, "state.json").write_text(json.dumps({"epoch": epoch}))
        chosen = train.Checkpoint.from_directory(folder) if train.get_context().get_world_rank() == 0 else None
        mode = train.CheckpointUploadMode[config["mode"]]
        train.report({"epoch": epoch, "world": int(total.item())}, checkpoint=chosen, checkpoint_upload_mode=mode)
        if mode is train.CheckpointUploadMode.SYNC:
            shutil.rmtree(folder)


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` (its children, theirs...), zombies left out."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))
            if fields and fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = [], {root}
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = set(children)
    return found


def _ours(pids: list[int]) -> list[int]:
    """The run's own processes among ``pids``: not the test's SSH servers."""
    found = []
    for pid in pids:
        try:
            if b"sshd" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


@pytest.mark.slow
@pytest.mark.parametrize(("where", "mode"), [("ssh hosts", "SYNC"), ("ssh hosts", "ASYNC"), ("this machine", "ASYNC")])
def test_random_kills_never_lose_a_report(request: pytest.FixtureRequest, storage: str, where: str, mode: str) -> None:
    ssh = request.getfixturevalue("ssh") if where == "ssh hosts" else None
    hosts = ["h0 slots=1", "h1 slots=1"] if ssh is not None else None
    rng = random.Random(int(os.environ.get("KILL_SEED", "0")) or None)
    seed_note = f"seed {rng.random()}"
    killed: list[str] = []
    done = threading.Event()

    def killer() -> None:
        time.sleep(2.0)
        while not done.is_set() and len(killed) < int(os.environ.get("KILLS", "8")):
            time.sleep(rng.uniform(0.1, 2.0))
            victims = ssh.ssh_processes() if ssh is not None else _ours(_descendants(os.getpid()))
            if not victims:
                continue
            pid = rng.choice(victims)
            try:
                comm = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:80].decode()
                os.kill(pid, signal.SIGKILL)
                killed.append(f"{pid} {comm}")
                print(f"KILLED {time.strftime('%H:%M:%S')} {pid} {comm}", flush=True)
            except (OSError, ProcessLookupError):
                pass

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        result = TorchTrainer(
            epochs_with_checkpoints,
            train_loop_config={"mode": mode},
            scaling_config=train.ScalingConfig(num_workers=2, hosts=hosts),
            run_config=train.RunConfig(
                name="killed", storage_path=storage, failure_config=train.FailureConfig(max_failures=-1)
            ),
        ).fit()
    finally:
        done.set()
        thread.join()
    took = time.monotonic() - started
    print(seed_note, f"took {took:.1f} s", *killed, sep="\n")
    assert result.error is None
    assert result.metrics["epoch"] == EPOCHS - 1 and result.metrics["world"] == 2
    assert json.loads(Path(result.checkpoint.path, "state.json").read_text()) == {"epoch": EPOCHS - 1}
    epochs = [m["epoch"] for m in result.metrics_history]
    # Every epoch is there; one redone after a restart follows its first report (nothing committed is lost).
    assert sorted(set(epochs)) == list(range(EPOCHS)), epochs
    run = json.loads(Path(storage, "killed", "run.json").read_text())
    assert len(run.get("attempt_errors", [])) <= len(killed), (run, killed)
