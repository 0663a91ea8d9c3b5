"""The tests' forked drivers (tests/forked_driver.py) stand in for ``python script.py``: the script
sees what that command would give it, and the leftover check sees them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import tagged_processes
from forked_driver import ForkedDriver, zygote_pids

# What a script can tell about how it was started.
PROBE = textwrap.dedent(
    """
    import os, signal, sys
    mask = os.umask(0)
    print(sys.argv[1:], os.getcwd(), sys.path[:3], os.environ.get("PROBE_VAR"), oct(mask))
    print(sys.stdout.line_buffering, sys.stdout.write_through, sys.stderr.line_buffering, sys.stderr.write_through)
    print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.getsignal(signal.SIGTERM))
    print("__main__", __name__, "torch" in sys.modules)
    sys.exit("the end")
    """
)


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_a_forked_driver_sees_what_python_script_py_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unbuffered: str
) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("PROBE_VAR", "set by the test")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["lib", str(tmp_path)]))
    monkeypatch.setenv("PYTHONUNBUFFERED", unbuffered)
    old_mask = os.umask(0o027)
    try:
        real = subprocess.run([sys.executable, str(script), "a b", "$c"], capture_output=True, text=True, timeout=60)
        forked = ForkedDriver(script, ["a b", "$c"])
        out, err = forked.communicate(timeout=60)
    finally:
        os.umask(old_mask)
    assert (forked.returncode, err) == (real.returncode, real.stderr) == (1, "the end\n")
    assert out.splitlines()[:-1] == real.stdout.splitlines()[:-1]
    assert (out.splitlines()[-1], real.stdout.splitlines()[-1]) == ("__main__ __main__ True", "__main__ __main__ False")


def test_the_leftover_check_counts_a_forked_driver_and_not_its_zygote(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    driver = ForkedDriver(script, [])
    try:
        assert driver.stdout.readline() == "up\n"
        assert driver.pid in tagged_processes()
        (zygote,) = zygote_pids()
        assert zygote not in tagged_processes()
        assert os.listdir(f"/proc/{zygote}/task") == [str(zygote)]  # no thread of the zygote's was left out of a fork
        assert driver.poll() is None
    finally:
        driver.send_signal(signal.SIGTERM)
    assert driver.wait(30) == -signal.SIGTERM
    driver.communicate(timeout=30)


# A driver whose workers say how they and their agent were started: the second fit's function
# comes from a module that starts a thread when imported, so that agent replaces itself (exec).
AGENT_PROBE = textwrap.dedent(
    """
    import json, os, sys
    import ddptrain as train
    import starts_a_thread

    def parent(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    def probe():
        agent = os.getppid()
        with open(f"/proc/{agent}/cmdline", "rb") as f:
            command = f.read().split(b"\\0")[:3]
        mask = os.umask(0)
        return {
            "agent_command": [part.decode() for part in command],
            "cwd": os.getcwd(),
            "umask": oct(mask),
            "path": sys.path,
            "orig_argv": sys.orig_argv[:3],
            "probe_var": os.environ.get("PROBE_VAR"),
            "server": parent(agent),
            "server_parent": parent(parent(agent)),
        }

    def probe_after_exec():
        starts_a_thread.loaded
        return probe()

    if __name__ == "__main__":
        seen = {"driver": os.getpid()}
        for name, func in (("forked", probe), ("replaced", probe_after_exec)):
            seen[name] = train.DataParallelTrainer(
                func,
                scaling_config=train.ScalingConfig(num_workers=1),
                run_config=train.RunConfig(storage_path=sys.argv[1], name=name),
            ).fit().return_value
        print(json.dumps(seen))
    """
)


@pytest.mark.slow
def test_a_forked_drivers_agents_see_what_those_of_python_script_py_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Their fork server is forked by the zygote (torch imported already), not started as a new
    # process of the driver's: the agents and workers must not be able to tell otherwise.
    script = tmp_path / "agents.py"
    script.write_text(AGENT_PROBE)
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\nloaded = 1\n"
    )
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("PROBE_VAR", "set by the test")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "lib"))
    old_mask = os.umask(0o027)
    try:
        real = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "real")], capture_output=True, text=True, timeout=120
        )
        forked = ForkedDriver(script, [str(tmp_path / "forked")])
        out, err = forked.communicate(timeout=120)
    finally:
        os.umask(old_mask)
    assert real.returncode == 0, real.stderr
    assert forked.returncode == 0, err
    real_seen, forked_seen = json.loads(real.stdout.splitlines()[-1]), json.loads(out.splitlines()[-1])
    for seen in (real_seen, forked_seen):
        assert "ddptrain.agent.main" in seen["replaced"]["agent_command"][2]  # the exec ran the agent's command
    assert real_seen["forked"]["server_parent"] == real_seen["driver"]
    assert forked_seen["forked"]["server_parent"] in zygote_pids()
    assert forked_seen["forked"]["server"] != forked_seen["driver"]
    for name in ("forked", "replaced"):
        for key in ("cwd", "umask", "path", "orig_argv", "probe_var"):
            assert forked_seen[name][key] == real_seen[name][key], (name, key)
    # Only the command line in /proc shows where a forked agent came from (the zygote's).
    assert forked_seen["replaced"]["agent_command"] == real_seen["replaced"]["agent_command"]
