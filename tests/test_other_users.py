"""What another Unix user of the machine can do to a user's runs: plant modules in a working
directory they share, read files ddptrain puts in /tmp, pre-create paths a run writes to, hold
locks. The test process is the user; :mod:`second_user` gives a real second account."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from second_user import OtherUser

ROOT = str(Path(__file__).resolve().parents[1])

# ----------------------------------------------------------------- a shared working directory

_PLANT = """
import os, sys
folder, names = sys.argv[1], sys.argv[2].split(",")
body = ("import os, sys\\n"
        "open(os.path.join(%r, 'IMPORTED-' + __name__ + '-%%d' %% os.getpid()), 'w').write(repr(sys.argv))\\n")
for name in names:
    with open(os.path.join(folder, name + ".py"), "w") as f:
        f.write(body % folder)
"""

# The user's own script, in a folder of theirs; run from the shared folder.
_DRIVER = """
import os, sys, tempfile
import ddptrain as train
from ddptrain import CheckpointUploadMode, ValidationConfig


def validate(checkpoint):
    return {"validated": 1.0}


def loop():
    d = tempfile.mkdtemp()
    open(os.path.join(d, "w.txt"), "w").write("x")
    train.report({"step": 0}, checkpoint=train.Checkpoint.from_directory(d),
                 checkpoint_upload_mode=CheckpointUploadMode.ASYNC, validation=True)
    return [c.metrics.get("validated") for c in train.get_all_reported_checkpoints()]


if __name__ == "__main__":
    result = train.DataParallelTrainer(
        loop, scaling_config=train.ScalingConfig(num_workers=2), validation_config=ValidationConfig(validate),
        run_config=train.RunConfig(name="planted", storage_path=sys.argv[1])).fit()
    print("RETURNED", result.return_values)
    try:
        from ddptrain.xgboost._tracker import TrackerProcess
    except ImportError:
        pass
    else:
        TrackerProcess(1, "127.0.0.1").stop(1.0)
        print("TRACKER")
"""


def _plantable_names() -> str:
    """Every top-level module a ddptrain process could import: the standard library's, what this
    process has loaded, and Python's start-up hooks."""
    import ddptrain.agent.main  # noqa: F401
    import ddptrain.driver.validation_child  # noqa: F401
    import ddptrain.storage.upload_process  # noqa: F401
    import ddptrain.worker.main  # noqa: F401

    names = {m.split(".")[0] for m in sys.modules} | set(sys.stdlib_module_names)
    names |= {"sitecustomize", "usercustomize", "xgboost"}
    return ",".join(sorted(n for n in names if n.isidentifier() and n != "__main__"))


def _console_script() -> str:
    """The ``ddptrain`` command of this installation."""
    found = shutil.which("ddptrain", path=os.path.dirname(sys.executable))
    if found is None:
        pytest.skip("no `ddptrain` command next to this python")
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_modules_planted_in_a_shared_working_directory_are_never_imported(
    other_user: OtherUser, shared_folder: Path, tmp_path: Path
) -> None:
    """Another user plants a module for every name ddptrain could import in a folder the user
    runs from (their script lives elsewhere). The validation process, `ddptrain check`'s probe
    and the XGBoost tracker (``python -c`` all three) imported ``pickle``, ``json``... from it,
    running the other user's code as the user."""
    other_user.run(_PLANT, str(shared_folder), _plantable_names())
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_DRIVER))
    (tmp_path / "hosts.txt").write_text("localhost slots=1\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = ROOT  # ddptrain as the tests import it: not from the shared folder
    fit = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "runs")],
        cwd=shared_folder, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    check = subprocess.run(
        [_console_script(), "check", str(tmp_path / "hosts.txt")],  # as typed (`python -m` would import cwd's)
        cwd=shared_folder, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    imported = {p.name: p.read_text() for p in shared_folder.glob("IMPORTED-*")}
    assert imported == {}, imported
    assert fit.returncode == 0 and "RETURNED [[1.0], [1.0]]" in fit.stdout, fit.stdout + fit.stderr
    assert check.returncode == 0 and "the probe did not run" not in check.stdout, check.stdout + check.stderr
