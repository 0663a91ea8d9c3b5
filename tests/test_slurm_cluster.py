"""Runs inside a real SLURM allocation (``tests/slurm.py``: slurmctld and nodes n0, n1 in their
own network namespaces): 2 nodes x 2 workers through ``salloc`` and ``sbatch``, a worker killed
(restart), a driver killed and a node killed (nothing left, a clear error naming the node).
The tests share one cluster; the node-killing test runs last."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

SCRIPT = r"""
import os, signal, socket, sys, tempfile, time
import ddptrain
from ddptrain import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ddptrain.torch import TorchTrainer

storage, mode = sys.argv[1], sys.argv[2]

def loop(config):
    import torch, torch.distributed as dist
    ctx = ddptrain.get_context()
    rank = ctx.get_world_rank()
    total = torch.ones(1) * (rank + 1)
    dist.all_reduce(total)
    print(f"rank {rank} on {socket.gethostname()} sum={total.item():g}", flush=True)
    start = 0
    if ddptrain.get_checkpoint() is not None:
        with ddptrain.get_checkpoint().as_directory() as d:
            start = int(open(os.path.join(d, "step")).read()) + 1
    steps = 1000 if mode in ("long", "preempt") else 3
    if mode == "preempt" and start > 0:  # the requeued job: two more steps
        steps = start + 2
    if mode == "elastic":  # until a node is lost, then two more steps on the one left
        steps = start + 2 if ctx.get_world_size() == 2 else 1000
    for step in range(start, steps):
        if mode == "kill" and rank == 3 and step == 1 and ctx.get_experiment_name() and start == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode in ("long", "preempt", "elastic") and rank == 0 and step == start:
            open(os.path.join(storage, "running"), "w").close()
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if rank == 0:
                open(os.path.join(d, "step"), "w").write(str(step))
                checkpoint = Checkpoint.from_directory(d)
            ddptrain.report({"step": step, "sum": total.item(), "host": socket.gethostname()}, checkpoint=checkpoint)
        if mode in ("long", "preempt", "elastic"):
            time.sleep(0.2)

trainer = TorchTrainer(
    loop,
    scaling_config=ScalingConfig(
        num_workers=(2, 4) if mode == "elastic" else 4, hosts=None if mode == "preempt" else "slurm"
    ),
    run_config=RunConfig(
        name=None if mode == "preempt" else "run",  # preempt: DDPTRAIN_RUN_NAME, from `ddptrain submit`
        storage_path=storage,
        failure_config=FailureConfig(max_failures=1),
    ),
)
result = trainer.fit()
print("RESULT", result.metrics, result.checkpoint.path, flush=True)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def _env(**extra: str) -> dict[str, str]:
    # Short knobs: a lost node is noticed within 3 s, a run's teardown waits 2 s.
    return {"DDPTRAIN_SSH_HEARTBEAT_TIMEOUT_S": "3", "DDPTRAIN_SHUTDOWN_GRACE_S": "2", **extra}


def _salloc(args: list[str], **env: str) -> subprocess.Popen[str]:
    """``salloc ARGS`` running, in a session of its own (``os.killpg`` ends it), its output in
    one pipe, with the short knobs of :func:`_env` (and ``env``) on top of the test's environment."""
    return subprocess.Popen(
        ["salloc", *args],
        env={**os.environ, **_env(**env)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _check_run(storage: Path, output: str) -> None:
    run = storage / "run"
    metrics = [json.loads(line)["metrics"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics][-3:] == [0, 1, 2]
    assert {m["sum"] for m in metrics} == {10.0}  # 1 + 2 + 3 + 4: all four ranks in one group
    assert (run / "checkpoint_000003" / "step").read_text() == "2"  # on the driver's disk
    logs = sorted((run / "logs").glob("attempt_*/rank_*.log"))
    text = {log.name: log.read_text() for log in logs}
    for rank, node in ((0, "n0"), (1, "n0"), (2, "n1"), (3, "n1")):
        assert any(f"rank {rank} on {node} sum=10" in t for name, t in text.items() if name == f"rank_{rank}.log")
        assert f"[{node}:rank{rank}]" in output  # the console names the node of each line
    assert "RESULT {'step': 2" in output


def test_two_nodes_through_salloc(slurm, script: Path, tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    started = time.monotonic()
    done = slurm.run(
        ["salloc", "-N2", "--ntasks-per-node=2", sys.executable, str(script), str(storage), "plain"],
        timeout_s=180,
        env=_env(),
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    _check_run(storage, output)
    print(f"salloc run: {time.monotonic() - started:.1f} s")


def test_two_nodes_through_sbatch(slurm, script: Path, tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    batch = tmp_path / "job.sh"
    out = tmp_path / "job.out"
    batch.write_text(
        f"#!/bin/sh\n#SBATCH --nodes=2 --ntasks-per-node=2 --output={out}\n"
        f"exec {sys.executable} {script} {storage} plain\n"
    )
    done = slurm.run(["sbatch", "--wait", str(batch)], timeout_s=180, env=_env())
    output = out.read_text() if out.exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + output
    _check_run(storage, output)


WORKER_ENV = r"""
import os, sys
import ddptrain
from ddptrain import RunConfig, ScalingConfig
from ddptrain.torch import TorchTrainer

def loop(config):
    import torch, torch.distributed as dist
    total = torch.ones(1)
    dist.all_reduce(total)
    env = {k: v for k, v in os.environ.items() if k.startswith("SLURM") or k.endswith("_SOCKET_IFNAME")}
    return {"sum": total.item(), "env": env}

result = TorchTrainer(
    loop,
    scaling_config=ScalingConfig(num_workers=4, hosts="slurm"),
    run_config=RunConfig(name="env", storage_path=sys.argv[1]),
).fit()
print("RESULT", result.return_values, flush=True)
"""


def test_nodes_whose_names_do_not_resolve_train_and_workers_see_the_allocation_not_the_step(
    slurm, tmp_path: Path
) -> None:
    """Neither node resolves its own name (its own /etc/hosts lacks it), so gloo, left alone,
    binds 127.0.0.1 on both and the group never forms: each node's agent must set the interface
    on its route to the driver. The workers' SLURM variables are the allocation's: the agent's
    one-task step (SLURM_PROCID=0, SLURM_NTASKS=1 on every node) must not show through."""
    script = tmp_path / "env.py"
    script.write_text(WORKER_ENV)
    hosts = (slurm.root / "hosts").read_text().splitlines()
    mounted = []
    try:
        for node in slurm.node_names:
            own = tmp_path / f"hosts-{node}"
            own.write_text("".join(line + "\n" for line in hosts if not line.endswith(f" {node}")))
            pid = str(slurm.slurmd_pid(node))
            subprocess.run(["nsenter", "-t", pid, "-m", "mount", "--bind", str(own), "/etc/hosts"], check=True)
            mounted.append(pid)
        done = slurm.run(
            ["salloc", "-N2", "--ntasks-per-node=2", "--job-name=envjob", sys.executable, str(script), str(tmp_path)],
            timeout_s=180,
            env=_env(DDPTRAIN_STORE_CONNECT_TIMEOUT_S="10"),
        )
    finally:
        for pid in mounted:
            subprocess.run(["nsenter", "-t", pid, "-m", "umount", "/etc/hosts"], check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    values = ast.literal_eval(output.split("RESULT ", 1)[1].splitlines()[0])
    assert [v["sum"] for v in values] == [4.0] * 4
    for rank, value in enumerate(values):
        env = value["env"]
        assert (env.get("GLOO_SOCKET_IFNAME"), env.get("NCCL_SOCKET_IFNAME")) == ("eth0", "eth0"), env
        assert env["SLURM_JOB_NAME"] == "envjob"  # not the agent step's name
        assert env["SLURM_JOB_NODELIST"] == "n[0-1]" and env["SLURMD_NODENAME"] == f"n{rank // 2}"
        step = sorted(k for k in env if k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_NNODES") or "STEP" in k)
        assert step == [], env


def test_a_killed_worker_restarts_the_group(slurm, script: Path, tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    done = slurm.run(
        ["salloc", "-N2", "--ntasks-per-node=2", sys.executable, str(script), str(storage), "kill"],
        timeout_s=180,
        env=_env(),
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "rank 3" in output and "SIGKILL" in output
    assert (storage / "run" / "logs" / "attempt_1").is_dir()  # a second attempt ran
    assert "RESULT {'step': 2" in output


COPY_BACK = r"""
import glob, os, signal, sys, tempfile
import ddptrain
from ddptrain import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ddptrain.torch import TorchTrainer

def loop(config):
    ctx = ddptrain.get_context()
    rank, start = ctx.get_world_rank(), 0
    if ddptrain.get_checkpoint() is not None:  # on n1 too: pushed into the node's staging folder
        with ddptrain.get_checkpoint().as_directory() as d:
            assert sorted(os.listdir(d)) == ["rank0", "rank1", "rank2", "rank3"], os.listdir(d)
            start = int(open(os.path.join(d, "rank%d" % rank)).read()) + 1
    for step in range(start, 3):
        if rank == 3 and step == 1 and start == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        with tempfile.TemporaryDirectory() as d:
            open(os.path.join(d, "rank%d" % rank), "w").write(str(step))
            ddptrain.report({"step": step}, checkpoint=Checkpoint.from_directory(d))

result = TorchTrainer(
    loop,
    scaling_config=ScalingConfig(num_workers=4, hosts="slurm"),
    run_config=RunConfig(name="run", storage_path=sys.argv[1], failure_config=FailureConfig(max_failures=1)),
).fit()
print("RESULT", result.metrics, result.checkpoint.path, flush=True)
"""


def test_checkpoints_of_a_node_without_the_run_directory_are_copied_back_and_pushed_for_a_resume(
    slurm, tmp_path: Path
) -> None:
    """n1 has a folder of its own where the driver keeps the run (a private mount in its mount
    namespace): its ranks' checkpoint files come back to the driver through job steps, the
    checkpoint to resume from goes to n1 the same way, and n1's staging folder is removed."""
    storage = tmp_path / "runs"
    storage.mkdir()
    script = tmp_path / "copy_back.py"
    script.write_text(COPY_BACK)
    pid = str(slurm.slurmd_pid("n1"))
    mounted = subprocess.run(["nsenter", "-t", pid, "-m", "mount", "-t", "tmpfs", "tmpfs", str(storage)], check=False)
    assert mounted.returncode == 0
    try:
        done = slurm.run(
            ["salloc", "-N2", "--ntasks-per-node=2", sys.executable, str(script), str(storage)],
            timeout_s=180,
            env=_env(),
        )
    finally:
        subprocess.run(["nsenter", "-t", pid, "-m", "umount", str(storage)], check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "SIGKILL" in output and (storage / "run" / "logs" / "attempt_1").is_dir()  # resumed once
    index = json.loads((storage / "run" / "checkpoints.json").read_text())
    last = storage / "run" / index["latest"]  # on the driver's disk, with n1's ranks' files
    assert {f.name: f.read_text() for f in last.iterdir()} == {f"rank{r}": "2" for r in range(4)}
    assert f"RESULT {{'step': 2}} {last}" in output
    assert not list(Path("/tmp").glob(f"ddptrain-{_run_id(storage)}*"))  # n1's staging folder is gone


NODE_FILES = r"""
import os, sys
from ddptrain.errors import LaunchError
from ddptrain.launch.slurm_files import NodeFiles
root = sys.argv[1]
files = NodeFiles("n1", sys.executable)
os.makedirs(os.path.join(root, "out", "sub"))
open(os.path.join(root, "out", "sub", "a.bin"), "wb").write(bytes(range(256)) * 64)
files.push_dir(os.path.join(root, "out"), os.path.join(root, "there"))
files.fetch_dir(os.path.join(root, "there"), os.path.join(root, "back"))
print("round trip", open(os.path.join(root, "back", "sub", "a.bin"), "rb").read() == bytes(range(256)) * 64,
      os.path.exists(os.path.join(root, "there")))
os.makedirs(os.path.join(root, "evil"))
os.symlink("/etc/passwd", os.path.join(root, "evil", "link"))
try:
    files.fetch_dir(os.path.join(root, "evil"), os.path.join(root, "taken"))
except LaunchError as exc:
    print("refused:", exc, os.listdir(os.path.join(root, "taken")))
"""


def test_node_files_copy_bytes_unchanged_and_refuse_a_link(slurm, tmp_path: Path) -> None:
    """A copy to a node and back keeps every byte value (the step's pipes are not a terminal)
    and removes the node's folder; a node that sends a link (or any name that is not a plain
    file or folder) is refused before anything of it is written."""
    script = tmp_path / "files.py"
    script.write_text(NODE_FILES)
    done = slurm.run(["salloc", "-N2", sys.executable, str(script), str(tmp_path)], timeout_s=120, env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "round trip True False" in done.stdout, done.stdout + done.stderr
    assert "refused: node 'n1' sent 'link'" in done.stdout and "not a plain file" in done.stdout, done.stdout
    assert done.stdout.rstrip().endswith("[]")  # nothing of it in the target folder


def _run_id(storage: Path) -> str:
    return json.loads((storage / "run" / "run.json").read_text())["run_id"]


def _wait_running(storage: Path, proc: subprocess.Popen[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (storage / "running").exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.1)


def test_slurms_usr1_to_every_process_of_the_steps_preempts_the_run(slurm, script: Path, tmp_path: Path) -> None:
    """`#SBATCH --signal=USR1@90` without `B:` (Lightning's habit) or `scancel --signal=USR1`:
    SLURM sends SIGUSR1 to every process of the job's steps (agents, workers). Nothing of ours
    may die of it: the agents take it as the hosts' preemption notice, the run commits a final
    checkpoint and ends PREEMPTED, naming the signal."""
    storage = tmp_path / "runs"
    storage.mkdir()
    proc = _salloc(
        ["-N2", "--ntasks-per-node=2", sys.executable, str(script), str(storage), "long"],
        DDPTRAIN_PREEMPTION_WINDOW_S="20",
    )
    try:
        _wait_running(storage, proc, 120)
        job = slurm.run(["squeue", "-h", "-o", "%i"]).stdout.split()
        assert len(job) == 1, job
        done = slurm.run(["scancel", "--signal=USR1", job[0]])
        assert done.returncode == 0, done.stderr
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            slurm.run(["scancel", "--user=root"])
            proc.communicate(timeout=30)
    assert "RunPreemptedError" in output, output
    assert "exit code 138" not in output and "died" not in output, output
    status = json.loads((storage / "run" / "run.json").read_text())
    assert status["status"] == "PREEMPTED", status
    # Both nodes' notices make one notice (not a second one, which would stop the run at once)
    reasons = status["preempted"]["reason"].split("; ")
    assert sorted(reasons) == ["SIGUSR1 to the agent on host n0", "SIGUSR1 to the agent on host n1"], status
    assert os.path.isdir(status["preempted"]["checkpoint"]), status
    both = r"preemption notice \(SIGUSR1 to the agent on host n.; SIGUSR1 to the agent on host n.\)"
    assert re.search(rf"ddptrain: {both}: the workers have", output), output  # the workers are told again
    assert re.search(rf"\[n.:rank.\] WARNING .*{both}", output), output


def test_a_killed_driver_leaves_nothing_on_the_nodes(slurm, script: Path, tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    storage.mkdir()
    # The allocation outlives the driver (`; sleep`): what ends its agents and workers is ddptrain's
    # own doing (the end of their stdin, the driver's heartbeats), not the end of the job.
    pid_file = tmp_path / "driver.pid"
    shell_pid = tmp_path / "shell.pid"
    command = f"echo $$ > {shell_pid}; {sys.executable} {script} {storage} long & echo $! > {pid_file}; wait; sleep 60"
    proc = _salloc(["-N2", "--ntasks-per-node=2", "sh", "-c", command])
    try:
        _wait_running(storage, proc, 120)
        assert len(slurm.node_processes("n1")) >= 3  # slurmstepd, the agent, its workers
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        killed = time.monotonic()
        left = slurm.wait_nodes_clean(15)
        # slurmstepd of the salloc's own `sh` is on no node (it runs on this side): only ours count
        assert not left, slurm.describe(left)
        print(f"nodes clean {time.monotonic() - killed:.1f} s after the driver's SIGKILL")
    finally:
        for pids in (shell_pid, pid_file):  # salloc runs its command in a process group of its own
            if pids.exists():
                try:
                    os.killpg(int(pids.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        os.killpg(proc.pid, signal.SIGKILL)
        slurm.run(["scancel", "--user=root"])  # and the allocation salloc held
        proc.communicate(timeout=30)


def test_ddptrain_check_slurm_reports_each_node(slurm) -> None:
    done = slurm.run(["salloc", "-N2", sys.executable, "-m", "ddptrain", "check", "slurm"], timeout_s=120, env=_env())
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    rows = [line for line in output.splitlines() if line.startswith(("n0 ", "n1 "))]
    assert len(rows) == 2 and all("srun ok" in row and row.rstrip().endswith("yes") for row in rows), output
    assert "all hosts are ready" in output


class _Submit:
    """``ddptrain submit`` running, its console read line by line in a thread."""

    def __init__(self, args: list[str], home: Path, **env: str) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddptrain", "submit", *args],
            env={**os.environ, **_env(HOME=str(home), **env)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def job_id(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while not (found := re.search(r"submitted batch job (\d+)", self.output)):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output
            time.sleep(0.1)
        return found.group(1)

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self._reader.join(5)
        return code


def test_submit_follows_the_job_and_exits_with_its_status(slurm, script: Path, tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    sub = _Submit(["--nodes=2", "--ntasks-per-node=2", "--", str(script), str(storage), "plain"], tmp_path)
    assert sub.wait(180) == 0, sub.output
    _check_run(storage, sub.output)  # the job's output, printed by `ddptrain submit`
    # the batch script and the output are the user's own
    folder = tmp_path / ".ddptrain" / "slurm"
    assert {oct(p.stat().st_mode & 0o777) for p in folder.glob("*.sbatch")} == {"0o600"}
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    # held in the queue: said, with the job id and SLURM's reason, until it is released
    failing = _Submit(["--hold", "--", "/bin/sh", "-c", "echo from the job; exit 3"], tmp_path)
    job = failing.job_id(60)
    deadline = time.monotonic() + 30
    while f"job {job} is pending in the queue (JobHeldUser)" not in failing.output:
        assert failing.proc.poll() is None and time.monotonic() < deadline, failing.output
        time.sleep(0.1)
    slurm.run(["scontrol", "release", job])
    assert failing.wait(60) == 3, failing.output
    assert "from the job" in failing.output and "exit status 3" in failing.output


def test_ctrl_c_cancels_the_submitted_job(slurm, script: Path, tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    storage.mkdir()
    sub = _Submit(["--nodes=2", "--ntasks-per-node=2", "--", str(script), str(storage), "long"], tmp_path)
    job = sub.job_id(60)
    deadline = time.monotonic() + 120
    while not (storage / "running").exists():
        assert sub.proc.poll() is None and time.monotonic() < deadline, sub.output
        time.sleep(0.1)
    os.kill(sub.proc.pid, signal.SIGINT)
    assert sub.wait(90) == 130, sub.output
    assert f"cancelling job {job}" in sub.output and f"job {job} cancelled" in sub.output
    left = slurm.wait_nodes_clean(15)
    assert not left, slurm.describe(left)


def test_a_slurm_warning_preempts_requeues_and_resumes(slurm, script: Path, tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    storage.mkdir()
    sub = _Submit(  # --signal as Lightning's docs teach it (to the steps): ours, to the batch shell, 90 s ahead
        ["--nodes=2", "--ntasks-per-node=2", "--signal=SIGUSR1@90", "--", str(script), str(storage), "preempt"],
        tmp_path,
        DDPTRAIN_PREEMPTION_WINDOW_S="20",
    )
    job = sub.job_id(60)
    assert "(B:USR1@90)" in sub.output
    batch = next((tmp_path / ".ddptrain" / "slurm").glob("*.sbatch")).read_text()
    assert "#SBATCH --signal=B:USR1@90" in batch and "#SBATCH --requeue" in batch and "SIGUSR1@90" not in batch
    deadline = time.monotonic() + 120
    while not (storage / "running").exists():
        assert sub.proc.poll() is None and time.monotonic() < deadline, sub.output
        time.sleep(0.1)
    (storage / "running").unlink()
    # What SLURM does at `--signal=B:USR1@S`: SIGUSR1 to the batch shell only
    done = slurm.run(["scancel", "--signal=USR1", "--batch", job])
    assert done.returncode == 0, done.stderr
    assert sub.wait(240) == 0, sub.output
    out = sub.output
    assert "SLURM warning signal" in out and f"requeueing job {job}" in out, out
    assert "RESULT" in out, out
    run = storage / f"ddptrain-{job}"  # the run's name, the same in both starts of the job
    status = json.loads((run / "run.json").read_text())
    assert status["status"] == "FINISHED", status
    steps = [json.loads(line)["metrics"]["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    stop = steps.index(max(steps[: len(steps) - 2]))  # the requeued start resumes after the last step
    assert steps[-2:] == [steps[stop] + 1, steps[stop] + 2], steps
    assert "resuming" in out.lower(), out


def test_an_elastic_run_goes_on_without_a_dead_node(slurm, script: Path, tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    storage.mkdir()
    # --no-kill: SLURM keeps the job when one of its nodes fails
    proc = _salloc(["-N2", "--no-kill", "--ntasks-per-node=2", sys.executable, str(script), str(storage), "elastic"])
    try:
        _wait_running(storage, proc, 120)
        (storage / "running").unlink()
        slurm.kill_node("n1")
        killed = time.monotonic()
        output, _ = proc.communicate(timeout=90)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    try:
        assert proc.returncode == 0, output
        assert "RESULT" in output and "n1" in output, output
        logs = storage / "run" / "logs" / "attempt_1"
        assert sorted(p.name for p in logs.glob("rank_*.log")) == ["rank_0.log", "rank_1.log"], output
        print(f"run finished on n0 alone {took:.1f} s after n1 died")
    finally:
        slurm.restart_node("n1")


def test_a_dead_node_fails_the_run_naming_it(slurm, script: Path, tmp_path: Path) -> None:
    """Last in the module: the node stays dead."""
    storage = tmp_path / "runs"
    storage.mkdir()
    proc = _salloc(["-N2", "--ntasks-per-node=2", sys.executable, str(script), str(storage), "long"])
    try:
        _wait_running(storage, proc, 120)
        slurm.kill_node("n1")
        killed = time.monotonic()
        output, _ = proc.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0
    assert "n1" in output.split("Training failed", 1)[-1], output
    assert "node 'n1'" in output or "host n1" in output, output
    assert "Node 'n1' of the SLURM allocation stopped answering: the run was not restarted" in output, output
    assert took < 20, f"the run ended {took:.1f} s after n1 died"
    print(f"run failed {took:.1f} s after the node died")
