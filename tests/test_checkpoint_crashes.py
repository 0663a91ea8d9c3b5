"""A driver killed at any moment of a checkpoint commit leaves a run that resumes, with every
listed checkpoint complete and nothing left over that the next run does not clean."""

from __future__ import annotations

import json
import os
import random
import signal
import textwrap
import time
from pathlib import Path

import pytest
from forked_driver import ForkedDriver

import ddptrain as train
from ddptrain._proc import stat_fields

SCRIPT = textwrap.dedent(
    """
    import json, os, shutil, signal, sys, tempfile
    from pathlib import Path
    import ddptrain as train

    def loop(config):
        start = 0
        checkpoint = train.get_checkpoint()
        if checkpoint:  # the checkpoint a resumed run gets is complete
            assert len(list(Path(checkpoint.path).rglob("*.bin"))) == 72, checkpoint.path
            start = json.loads(Path(checkpoint.path, "state.json").read_text())["step"] + 1
        rank = train.get_context().get_world_rank()
        for step in range(start, config["steps"]):
            with tempfile.TemporaryDirectory() as d:
                for part in range(6):  # folders of files: deleting a checkpoint takes a while
                    Path(d, f"part_{part}").mkdir()
                    for i in range(6):
                        Path(d, f"part_{part}", f"rank{rank}_{i}.bin").write_bytes(b"x" * 1000)
                Path(d, "state.json").write_text(json.dumps({"step": step}))
                name = config["name_format"].format(step) if config["name_format"] else None
                train.report(
                    {"step": step, "score": step % 3},
                    checkpoint=train.Checkpoint.from_directory(d),
                    checkpoint_dir_name=name,
                )
            print("step", step, flush=True)
        return start

    def die_at(point, run_dir):
        # Crash injection, not a fake: the driver SIGKILLs itself at one moment of a commit.
        calls = {"index": 0, "renames": 0, "deletions": 0, "deleting": False, "unlinks": 0}

        def profile(frame, event, arg):
            if point == "index" and event == "c_call" and arg is os.replace:
                if str(frame.f_locals.get("path", "")).endswith("checkpoints.json"):
                    calls["index"] += 1
                    if calls["index"] == 3:  # the third commit's index is written, not yet in place
                        os.kill(os.getpid(), signal.SIGKILL)
            if point == "rename" and event == "c_call" and arg is os.rename and "building" in frame.f_locals:
                calls["renames"] += 1
                if calls["renames"] == 2:  # the second checkpoint is built, not yet renamed into place
                    os.kill(os.getpid(), signal.SIGKILL)
            if point == "delete" and frame.f_code is shutil.rmtree.__code__:
                path = Path(frame.f_locals["path"])
                if event == "call" and path.parent == Path(run_dir) and not path.name.startswith("."):
                    calls["deletions"] += 1
                    calls["deleting"] = calls["deletions"] >= 2
                elif event == "return":
                    calls["deleting"] = False
            if point == "delete" and event == "c_call" and arg is os.unlink and calls["deleting"]:
                calls["unlinks"] += 1
                if calls["unlinks"] == 5:  # halfway through deleting a checkpoint retention dropped
                    os.kill(os.getpid(), signal.SIGKILL)

        sys.setprofile(profile)

    if __name__ == "__main__":
        storage, name_format, steps, crash = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
        if crash != "none":
            die_at(crash, os.path.join(storage, "crashy"))
        result = train.DataParallelTrainer(
            loop,
            train_loop_config={"steps": steps, "name_format": name_format},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(
                name="crashy",
                storage_path=storage,
                checkpoint_config=train.CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score"),
            ),
        ).fit()
        print("RESULT", json.dumps({"start": result.return_value, "checkpoint": result.checkpoint.path}))
    """
)

NAME_FORMATS = {"default names": "", "step_{} names": "step_{}"}


def assert_complete(checkpoint: train.Checkpoint) -> int:
    """The checkpoint has every file both ranks wrote; returns its step."""
    files = sorted(p.relative_to(checkpoint.path).as_posix() for p in Path(checkpoint.path).rglob("*.bin"))
    expected = sorted(f"part_{p}/rank{r}_{i}.bin" for p in range(6) for r in range(2) for i in range(6))
    assert files == expected, f"{checkpoint.path} is incomplete"
    return int(json.loads(Path(checkpoint.path, "state.json").read_text())["step"])


def assert_loadable(run_dir: Path) -> int:
    """Every checkpoint a crashed run directory lists is complete; returns the latest step."""
    result = train.Result.from_path(run_dir)
    for checkpoint, _ in result.best_checkpoints:
        assert_complete(checkpoint)
    return assert_complete(result.checkpoint) if result.checkpoint else -1


def assert_nothing_left_over(run_dir: Path) -> None:
    """Only the run's files and its committed checkpoints remain."""
    index = json.loads((run_dir / "checkpoints.json").read_text())
    committed = {entry["dir_name"] for entry in index["checkpoints"]}
    expected = {"run.json", "trainer.pkl", "metrics.jsonl", "metrics_summary.json", "checkpoints.json", "logs"}
    expected |= committed
    found = {p.name for p in run_dir.iterdir()}
    assert found <= expected, f"left over in {run_dir}: {sorted(found - expected)}"
    assert committed <= found


def start(script: Path, storage: str, name_format: str, steps: int, crash: str = "none") -> ForkedDriver:
    """The driver script in a process of its own (forked: it need not import torch again)."""
    return ForkedDriver(script, [storage, name_format, str(steps), crash])


def finish(script: Path, storage: str, name_format: str, steps: int) -> tuple[dict, str]:
    proc = start(script, storage, name_format, steps)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.split("RESULT ", 1)[1]), err


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "crashy.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name_format", NAME_FORMATS.values(), ids=NAME_FORMATS.keys())
def test_a_driver_killed_mid_commit_resumes_and_leaves_nothing_behind(
    script: Path, storage: str, name_format: str
) -> None:
    run_dir = Path(storage, "crashy")
    # 1. Killed after the third checkpoint was renamed into place, before the index listed it.
    proc = start(script, storage, name_format, 20, crash="index")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    assert assert_loadable(run_dir) == 1

    # 2. The next run resumes, adopting that checkpoint, and is killed before renaming one.
    proc = start(script, storage, name_format, 20, crash="rename")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    assert f"adopted checkpoint '{name_format.format(2) or 'checkpoint_000003'}'" in err
    assert assert_loadable(run_dir) == 3

    # 3. The next run discards the half-committed one, and is killed while retention deletes one.
    proc = start(script, storage, name_format, 20, crash="delete")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    assert f"discarded checkpoint '{name_format.format(4) or 'checkpoint_000005'}'" in err
    last = assert_loadable(run_dir)

    # 4. The run resumes from its latest checkpoint, finishes, and cleans up after every crash.
    summary, _ = finish(script, storage, name_format, last + 3)
    assert summary["start"] == last + 1
    assert assert_complete(train.Checkpoint(summary["checkpoint"])) == last + 2
    assert_nothing_left_over(run_dir)


def kill_at_random(script: Path, storage: str, name_format: str, kills: int) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    run_dir = Path(storage, "crashy")
    for kill in range(kills):
        proc = start(script, storage, name_format, 100_000)
        assert proc.stdout is not None
        # The first kill lands while checkpoints are committed, the second during the start-up
        # that recovers from it; a soak run's further kills pick either (one in four at start-up).
        if kill == 1 or (kill > 1 and rng.random() < 0.25):  # start-up: resume, recovery of the crash
            time.sleep(rng.uniform(0.0, 0.3))  # a forked driver's run and agent start within ~0.3 s
        else:  # while checkpoints are committed, one every few milliseconds
            proc.stdout.readline()
            time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, f"kill {kill} (seed {seed}): the run failed on its own:\n{err}"
        if (run_dir / "run.json").exists():
            assert_loadable(run_dir)
    last = assert_loadable(run_dir) if (run_dir / "run.json").exists() else -1
    summary, _ = finish(script, storage, name_format, last + 3)
    # The commit a kill interrupted may have been adopted: then the run starts one step later.
    assert summary["start"] in (last + 1, last + 2), f"seed {seed}"
    assert assert_complete(train.Checkpoint(summary["checkpoint"])) == last + 2
    assert_nothing_left_over(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name_format", NAME_FORMATS.values(), ids=NAME_FORMATS.keys())
def test_many_random_driver_kills_never_make_a_run_unresumable(script: Path, storage: str, name_format: str) -> None:
    # 2 with each naming scheme in CI, one in each phase (mid-commit, then the start-up that
    # recovers from it) at a random moment: each run draws a new seed; the crash points
    # themselves are covered one by one above. DDPTRAIN_SOAK_KILLS=25 for a soak run.
    kill_at_random(script, storage, name_format, kills=int(os.environ.get("DDPTRAIN_SOAK_KILLS", "2")))


# A run that uploads its checkpoints in the background and validates them, killed at a random
# moment: while uploads, commits and validations are in flight, or once its function returned.
ASYNC_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, tempfile, time
    import ddptrain as train
    from ddptrain import CheckpointUploadMode

    def loop(config):
        start = 0
        if (checkpoint := train.get_checkpoint()) is not None:
            start = json.loads(open(os.path.join(checkpoint.path, "state.json")).read())["step"] + 1
        rank = train.get_context().get_world_rank()
        for step in range(start, config["steps"]):
            folder = tempfile.mkdtemp()
            open(os.path.join(folder, f"rank{rank}.bin"), "wb").write(b"x" * 100_000)
            json.dump({"step": step}, open(os.path.join(folder, "state.json"), "w"))
            train.report({"step": step}, checkpoint=train.Checkpoint.from_directory(folder),
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC, validation=step % 2 == 0)
            if rank == 0:
                print("step", step, flush=True)
            time.sleep(0.2)
        return start

    def validate(checkpoint):
        time.sleep(0.5)
        return {"val": 1.0}

    if __name__ == "__main__":
        result = train.DataParallelTrainer(
            loop,
            train_loop_config={"steps": int(sys.argv[2])},
            scaling_config=train.ScalingConfig(num_workers=2),
            validation_config=train.ValidationConfig(validate),
            run_config=train.RunConfig(name="async", storage_path=sys.argv[1],
                                       checkpoint_config=train.CheckpointConfig(num_to_keep=2)),
        ).fit()
        print("RESULT", json.dumps({"start": result.return_value}))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_driver_killed_amid_uploads_and_validations_leaves_nothing_and_resumes(tmp_path: Path, storage: str) -> None:
    from conftest import tagged_processes

    seed = int(os.environ.get("DDPTRAIN_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    rng = random.Random(seed)
    script = tmp_path / "async_driver.py"
    script.write_text(ASYNC_SCRIPT)
    run_dir = Path(storage, "async")
    proc = ForkedDriver(script, [storage, "12"])
    kill_after = f"step {rng.choice([1, 4, 7, 11])}"  # step 11: the function returns, validations wait
    for line in proc.stdout:
        if line.rstrip().endswith(kill_after):
            break
    time.sleep(rng.uniform(0.0, 0.3))
    proc.kill()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"seed {seed}: the run ended on its own:\n{err}"
    deadline = time.monotonic() + 10  # workers, agent, upload and validation processes, fork server
    while tagged_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = tagged_processes()
    assert left == [], f"seed {seed}, {kill_after}: left running:\n{describe_processes(left)}"
    last = assert_loadable_async(run_dir)
    before = (run_dir / "metrics.jsonl").read_text()
    rerun = ForkedDriver(script, [storage, "14"])
    out, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, f"seed {seed}:\n{err}"
    # The commit a kill interrupted may have been adopted: then the run starts one step later.
    assert json.loads(out.split("RESULT ", 1)[1])["start"] in (last + 1, last + 2), f"seed {seed}"
    if last >= 0:
        assert f"resuming run 'async' from checkpoint {run_dir}" in err, f"seed {seed}:\n{err}"
    assert (run_dir / "metrics.jsonl").read_text().startswith(before)  # every report kept, once


def describe_processes(pids: list[int]) -> str:
    """One line per process: pid, parent, state and command line."""
    lines = []
    for pid in pids:
        fields = stat_fields(pid)
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            command = None
        if fields and command is not None:
            lines.append(f"{pid} (parent {fields[1]}, state {fields[0]}): {command[:300]}")
        else:
            lines.append(f"{pid}: gone")
    return "\n".join(lines)


def assert_loadable_async(run_dir: Path) -> int:
    """Every listed checkpoint of the async run has both ranks' files; returns the latest step."""
    result = train.Result.from_path(run_dir)
    for checkpoint, _ in result.best_checkpoints:
        assert sorted(p.name for p in Path(checkpoint.path).iterdir()) == ["rank0.bin", "rank1.bin", "state.json"]
    if result.checkpoint is None:
        return -1
    return int(json.loads(Path(result.checkpoint.path, "state.json").read_text())["step"])
