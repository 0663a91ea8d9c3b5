"""The controller's restart policy (``ddptrain.driver.controller``), with real worker processes on this
machine: every attempt gets a placement plan of its own, and a next attempt that cannot start
ends the run with an error that says so."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import ddptrain as train
from ddptrain.errors import WorkerGroupError


def _record_and_fail_once(config: dict) -> None:
    """Every rank records what its attempt looks like; rank 0 of the first attempt rewrites the
    host file, then fails the attempt."""
    ctx = train.get_context()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    out = Path(config["out"], f"a{attempt}_r{ctx.get_world_rank()}.json")
    out.write_text(json.dumps({"local_world_size": ctx.get_local_world_size(), "node_rank": ctx.get_node_rank()}))
    if attempt == 0 and ctx.get_world_rank() == 0:
        Path(config["hostfile"]).write_text(config["next_hosts"])
        raise RuntimeError("first attempt fails on purpose")


def _trainer(tmp_path: Path, storage: str, next_hosts: str) -> train.DataParallelTrainer:
    hostfile = tmp_path / "hosts"
    # Two "hosts" that are both this machine (no SSH): one worker each.
    hostfile.write_text(f"localhost slots=1\n{socket.gethostname()} slots=1\n")
    out = tmp_path / "records"
    out.mkdir()
    return train.DataParallelTrainer(
        _record_and_fail_once,
        train_loop_config={"out": str(out), "hostfile": str(hostfile), "next_hosts": next_hosts},
        scaling_config=train.ScalingConfig(num_workers=2, hosts=str(hostfile)),
        run_config=train.RunConfig(
            name="replan", storage_path=storage, failure_config=train.FailureConfig(max_failures=1)
        ),
    )


@pytest.mark.timeout(180)
def test_each_restart_reads_the_host_file_again(tmp_path: Path, storage: str) -> None:
    result = _trainer(tmp_path, storage, next_hosts="localhost slots=2\n").fit()

    assert result.error is None
    records = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "records").iterdir()}
    # Attempt 0 ran one worker on each of two hosts; attempt 1 both on the one host the file now lists.
    assert [records[f"a0_r{r}"] for r in (0, 1)] == [{"local_world_size": 1, "node_rank": r} for r in (0, 1)]
    assert [records[f"a1_r{r}"] for r in (0, 1)] == [{"local_world_size": 2, "node_rank": 0}] * 2
    run = json.loads((Path(storage) / "replan" / "run.json").read_text())
    assert run["hosts"] == ["localhost"] and run["status"] == "FINISHED"


@pytest.mark.timeout(180)
def test_a_next_attempt_that_cannot_start_ends_the_run_saying_why(tmp_path: Path, storage: str) -> None:
    # The host file now asks for more slots than it has: the next plan is refused (twice: early,
    # during the teardown, and again once the group is down), and the run ends with that reason
    # next to the attempt's own failure.
    with pytest.raises(WorkerGroupError) as caught:
        _trainer(tmp_path, storage, next_hosts="localhost slots=1\n").fit()

    message = str(caught.value)
    assert "first attempt fails on purpose" in message
    assert "The next attempt could not start:" in message and "slot" in message
    run = json.loads((Path(storage) / "replan" / "run.json").read_text())
    assert run["status"] == "ERRORED" and [e["attempt"] for e in run["attempt_errors"]] == [0]
    assert not (tmp_path / "records" / "a1_r0.json").exists()


def test_no_host_is_reached_before_the_runs_lock_is_taken(storage: str) -> None:
    """A fit whose run another driver holds fails on the lock, before its plan probes any host
    (with use_gpu, a host list without slots is asked for its GPUs over SSH)."""
    run_dir = os.path.join(storage, "busy")
    os.makedirs(run_dir)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom ddptrain.storage.lock import RunLock\n"
            f"with RunLock({run_dir!r}, 'busy'):\n    print('held', flush=True)\n    time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(train.DdpTrainError, match=r"'busy' .* in use by a live driver") as info:
            train.DataParallelTrainer(
                lambda: None,
                scaling_config=train.ScalingConfig(num_workers=1, use_gpu=True, hosts=["ghost.invalid"]),
                run_config=train.RunConfig(name="busy", storage_path=storage),
            ).fit()
        assert "ghost" not in str(info.value)
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()
