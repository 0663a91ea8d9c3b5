"""Reading a SLURM allocation: the node list expander (against real ``scontrol show hostnames``
outputs), slots per node, and ``hosts="slurm"`` outside an allocation. No cluster needed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from ddptrain import ScalingConfig
from ddptrain.driver.plan import Plan
from ddptrain.errors import ConfigError
from ddptrain.launch.slurm_allocation import allocation_hosts, expand_nodelist, tasks_per_node

# `scontrol show hostnames LIST` of slurm-wlm 22.05.8 (Debian 12), recorded.
SCONTROL = {
    "n[0-3,7],gpu-a[01-02]": "n0 n1 n2 n3 n7 gpu-a01 gpu-a02",
    "r[1-2]n[01-02]": "r1n01 r1n02 r2n01 r2n02",
    "n[3,1],n1": "n3 n1 n1",
    "a,b[9-11]": "a b9 b10 b11",
    "n[1-010]": "n1 n2 n3 n4 n5 n6 n7 n8 n9 n10",
    "n[08-11]": "n08 n09 n10 n11",
    "node-1": "node-1",
    "n[0-1]": "n0 n1",
}


@pytest.mark.parametrize("nodelist", sorted(SCONTROL))
def test_nodelist_expands_as_scontrol_does(nodelist: str, tmp_path) -> None:
    assert expand_nodelist(nodelist) == SCONTROL[nodelist].split()
    if shutil.which("scontrol"):  # and against the real one, where installed
        conf = tmp_path / "slurm.conf"
        conf.write_text("ClusterName=x\nSlurmctldHost=localhost\n")
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            env={**os.environ, "SLURM_CONF": str(conf)},
            check=True,
        ).stdout
        assert expand_nodelist(nodelist) == out.split()


@pytest.mark.parametrize("bad", ["n[0-", "n0-1]", "n[a-b]", "n[3-1]", ""])
def test_malformed_nodelist_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="SLURM node list"):
        expand_nodelist(bad)


def test_tasks_per_node_forms() -> None:
    assert tasks_per_node("2(x3),1", 4) == [2, 2, 2, 1]
    assert tasks_per_node("4", 3) == [4, 4, 4]
    assert tasks_per_node("1(x2)", 2) == [1, 1]
    with pytest.raises(ConfigError, match="gives 2 counts for 3 nodes"):
        tasks_per_node("2(x2)", 3)
    with pytest.raises(ConfigError, match="expected e.g."):
        tasks_per_node("2x", 1)


def test_slots_from_the_allocation() -> None:
    job = {"SLURM_JOB_NODELIST": "n[0-2]", "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_CPUS_ON_NODE": "8"}
    hosts = allocation_hosts(job)
    assert [(h.name, h.slots, h.srun) for h in hosts] == [("n0", 2, True), ("n1", 2, True), ("n2", 1, True)]
    assert [h.slots for h in allocation_hosts({**job, "SLURM_NTASKS_PER_NODE": "3"})] == [3, 3, 3]
    gpus = {**job, "SLURM_GPUS_ON_NODE": "4"}
    assert [h.slots for h in allocation_hosts(gpus, use_gpu=True, gpus_per_worker=2)] == [2, 2, 2]
    assert [h.slots for h in allocation_hosts({**job, "SLURM_JOB_GPUS": "0,1,3"}, use_gpu=True)] == [3, 3, 3]
    assert [h.slots for h in allocation_hosts(gpus)] == [2, 2, 1]  # CPU workers: the tasks
    only_cpus = {"SLURM_JOB_NODELIST": "c1,c2", "SLURM_CPUS_ON_NODE": "4"}
    assert [h.slots for h in allocation_hosts(only_cpus)] == [4, 4]


def test_gpu_slots_under_salloc_come_from_the_gpus_asked_per_node() -> None:
    # Under salloc the driver runs outside the job's nodes: SLURM sets neither SLURM_GPUS_ON_NODE
    # nor SLURM_JOB_GPUS there, only what was asked (`--gpus-per-node=[type:]N`).
    job = {"SLURM_JOB_NODELIST": "g[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_CPUS_PER_NODE": "32(x2)"}
    assert [h.slots for h in allocation_hosts({**job, "SLURM_GPUS_PER_NODE": "4"}, use_gpu=True)] == [4, 4]
    typed = {**job, "SLURM_GPUS_PER_NODE": "h200:4"}
    assert [h.slots for h in allocation_hosts(typed, use_gpu=True, gpus_per_worker=2)] == [2, 2]
    assert [h.slots for h in allocation_hosts(typed)] == [1, 1]  # CPU workers: the tasks
    on_node = {**typed, "SLURM_GPUS_ON_NODE": "2"}  # in the batch step: what the node has
    assert [h.slots for h in allocation_hosts(on_node, use_gpu=True)] == [2, 2]
    none_in_this_step = {**typed, "SLURM_GPUS_ON_NODE": "0"}  # an interactive step without GPUs
    assert [h.slots for h in allocation_hosts(none_in_this_step, use_gpu=True)] == [4, 4]


def test_hosts_slurm_outside_an_allocation_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    config = ScalingConfig(num_workers=2, hosts="slurm")  # the allocation is read at fit()
    with pytest.raises(ConfigError, match="not in one .SLURM_JOB_NODELIST is not set.*sbatch.*salloc"):
        Plan.read_hosts(config)
    monkeypatch.setenv("DDPTRAIN_HOSTFILE", "slurm")
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST is not set"):
        Plan.read_hosts(ScalingConfig(num_workers=2))


def test_hosts_slurm_places_workers_on_the_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[0-1]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    plan = Plan(ScalingConfig(num_workers=4, hosts="slurm"))
    assert plan.rank_labels() == {0: "n0:rank0", 1: "n0:rank1", 2: "n1:rank2", 3: "n1:rank3"}
    with pytest.raises(ConfigError, match="needs 5 slots, but the hosts have 4"):
        Plan(ScalingConfig(num_workers=5, hosts="slurm"))


# --------------------------------------------------------------------- ddptrain submit's parts
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nodes": 0}, "`SlurmConfig(nodes=...)` must be an integer >= 1, got 0"),
        ({"workers_per_node": "4"}, "`SlurmConfig(workers_per_node=...)` must be an integer >= 1, got '4'"),
        ({"job_name": "a b"}, "`SlurmConfig(job_name=...)` must be 1-64 letters"),
        ({"extra": ["--output=x.log"]}, "leave out '--output=x.log'"),
        ({"extra": "--qos=low"}, "must be a list of sbatch options"),
        ({"extra": ["--signal=B:USR1@300"]}, "and `signal_s=120` both ask for a warning signal"),
    ],
)
def test_slurm_config_rejects_bad_input(kwargs: dict[str, object], message: str) -> None:
    from ddptrain import SlurmConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        SlurmConfig(**kwargs)  # type: ignore[arg-type]


def test_the_batch_script_passes_hostile_arguments_intact(tmp_path) -> None:
    """The batch script run by bash (as SLURM's batch host runs it), with a command and a working
    directory full of shell syntax: the program gets its arguments as given."""
    from ddptrain import SlurmConfig
    from ddptrain.launch.slurm_submit import batch_script

    workdir = tmp_path / "wörk dir $HOME 'q' \"d\" `x`"
    workdir.mkdir()
    hostile = ["a b", "$HOME", "'", '"', "`id`", "; echo pwned", "ü"]
    script = batch_script(
        SlurmConfig(nodes=2), ["/bin/sh", "-c", 'printf "<%s>" "$@"; pwd', "sh", *hostile], str(workdir), "out"
    )
    assert "#SBATCH --nodes=2" in script and "#SBATCH --signal=B:USR1@120" in script and "#SBATCH --requeue" in script
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n0"}
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert "".join(f"<{a}>" for a in hostile) in done.stdout
    assert done.stdout.rstrip().endswith(str(workdir))
    assert "run ddptrain-77" in done.stdout  # DDPTRAIN_RUN_NAME: job name and id


def test_run_name_from_the_environment(monkeypatch, tmp_path) -> None:
    from ddptrain import RunConfig
    from ddptrain.storage.location import RunLocation

    monkeypatch.setenv("DDPTRAIN_RUN_NAME", "ddptrain-77")
    assert RunLocation.of(RunConfig(storage_path=str(tmp_path))).name == "ddptrain-77"
    assert RunLocation.of(RunConfig(name="mine", storage_path=str(tmp_path))).name == "mine"
    monkeypatch.setenv("DDPTRAIN_RUN_NAME", "../up")
    with pytest.raises(ValueError, match="plain folder name"):
        RunLocation.of(RunConfig(storage_path=str(tmp_path)))


def test_an_agent_step_drops_the_steps_variables_and_keeps_the_users() -> None:
    from ddptrain.launch.slurm import step_env

    env = step_env({"A": "1", "SLURM_NTASKS": "8"}, "10.0.0.1", {"SLURM_JOB_NAME": "train"})
    unset = env.pop("DDPTRAIN_UNSET").split(",")
    assert env == {"A": "1", "SLURM_NTASKS": "8", "SLURM_JOB_NAME": "train", "DDPTRAIN_ROUTE_TO": "10.0.0.1"}
    assert {"SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_*"} <= set(unset)
    assert "SLURM_NTASKS" not in unset  # the user's own value stays
    unnamed = step_env({}, "10.0.0.1", {})  # no allocation name known: the step's is dropped too
    assert "SLURM_JOB_NAME" in unnamed["DDPTRAIN_UNSET"].split(",") and "SLURM_JOB_NAME" not in unnamed


@pytest.mark.parametrize(
    ("options", "lead", "rest"),
    [
        (["--signal=SIGUSR1@90", "--qos=low"], 90, ["--qos=low"]),
        (["--qos=low", "--signal", "B:USR1@300"], 300, ["--qos=low"]),
        (["--signal=10"], 60, []),  # sbatch's default lead time
        (["--signal=B:USR2@60"], None, ["--signal=B:USR2@60"]),  # another signal: the user's own
        (["--time=1:00:00"], None, ["--time=1:00:00"]),
    ],
)
def test_a_usr1_signal_option_sets_the_warnings_lead_time(
    options: list[str], lead: int | None, rest: list[str]
) -> None:
    from ddptrain import SlurmConfig
    from ddptrain.launch.slurm_submit import warning_option

    assert warning_option(options) == (lead, rest)
    if lead is None:  # kept as the user's own, which SlurmConfig takes with signal_s=0 (no requeue)
        assert "--requeue" not in SlurmConfig(signal_s=0, extra=rest).sbatch_options()


def test_submit_refuses_a_missing_script_before_sbatch(tmp_path, monkeypatch, capsys) -> None:
    """The job would only fail once it left the queue, minutes or hours later."""
    from ddptrain.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch: the check comes first
    assert main(["submit", "--nodes=1", "--", "trian.py", "--lr", "0.1"]) == 2
    err = capsys.readouterr().err
    assert f"ddptrain submit: no such script: {tmp_path}/trian.py (the job runs `trian.py` in {tmp_path})." in err
