"""The tests' forked drivers (tests/forked_driver.py) stand in for ``python script.py``: the script
sees what that command would give it, and the leftover check sees them."""

from __future__ import annotations

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
