"""What another Unix user of the machine can do to a user's runs: plant modules in a working
directory they share, read files ddptrain puts in /tmp, pre-create paths a run writes to, hold
locks. The test process is the user; :mod:`second_user` gives a real second account."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
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

_AS_PACKAGE = """
import os, sys
os.mkdir(sys.argv[1])
os.rename(sys.argv[1] + ".py", os.path.join(sys.argv[1], "__init__.py"))
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


def test_the_agent_imports_nothing_from_a_shared_working_directory_however_python_starts(
    other_user: OtherUser, shared_folder: Path
) -> None:
    """The agent's first line imported ``types`` and ``importlib.machinery`` before it took the
    working directory off ``sys.path``. Where Python's start-up has not loaded them already
    (Python 3.10 and 3.12, Debian's 3.11, an installation without a ``.pth`` that imports them;
    ``-S`` stands for those here), a ``types.py`` or ``importlib/`` planted in the working
    directory ran as the user, in every local run's agent."""
    from ddptrain.wire.boot import agent_command, import_pins

    other_user.run(_PLANT, str(shared_folder), "types,importlib,os,sitecustomize,usercustomize")
    other_user.run(_AS_PACKAGE, str(shared_folder / "importlib"))  # a package wins over the stdlib's too
    python, *rest = agent_command(sys.executable, import_pins())
    subprocess.run(
        [python, "-S", *rest], cwd=shared_folder, stdin=subprocess.DEVNULL, capture_output=True, timeout=60
    )  # no bootstrap on stdin: the agent ends at once (or fails to import, without site-packages)
    imported = {p.name: p.read_text() for p in shared_folder.glob("IMPORTED-*")}
    assert imported == {}, imported


# ----------------------------------------------------------------- run folders other users made

_MAKE_RUN_FOLDER = """
import os, pickle, sys
folder, marker = sys.argv[1], sys.argv[2]
os.mkdir(folder, 0o755)

class Payload:
    def __reduce__(self):  # runs as whoever unpickles it
        return (os.system, ("touch " + marker,))

with open(os.path.join(folder, "trainer.pkl"), "wb") as f:
    pickle.dump(Payload(), f)
"""


def report_once() -> None:
    import ddptrain as train

    train.report({"secret_metric": 42})


def test_a_run_folder_another_user_created_is_refused(
    other_user: OtherUser, shared_folder: Path, tmp_path: Path
) -> None:
    """Another user creates the folder of a run before it, on a storage path both can write
    (here its own ``trainer.pkl`` in it). The driver used to write the run's metrics and logs
    into it, where that user reads them; ``restore()`` unpickled its ``trainer.pkl``."""
    import ddptrain as train
    from ddptrain.storage.ownership import ForeignFolderError

    marker = tmp_path / "unpickled"
    other_user.run(_MAKE_RUN_FOLDER, str(shared_folder / "run"), str(marker))
    with pytest.raises(ForeignFolderError, match=rf"run folder .*run belongs to {other_user.name} "):
        train.DataParallelTrainer(
            report_once,
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(name="run", storage_path=str(shared_folder)),
        ).fit()
    assert sorted(p.name for p in (shared_folder / "run").iterdir()) == ["trainer.pkl"]  # nothing written
    with pytest.raises(ForeignFolderError, match=rf"belongs to {other_user.name} "):
        train.DataParallelTrainer.restore(str(shared_folder / "run"))
    assert not marker.exists()


def test_a_run_in_a_folder_anyone_can_write_without_the_sticky_bit_is_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """In such a storage folder any user can rename the run's folder away and put theirs in
    its place; with the sticky bit (as /tmp has) only its owner can. File systems without Unix
    modes look like that too, so it is a warning, not an error."""
    import logging

    import ddptrain as train

    storage = tmp_path / "open"
    storage.mkdir()
    storage.chmod(0o777)
    run_config = train.RunConfig(name="run", storage_path=str(storage))
    trainer = train.DataParallelTrainer(
        report_once, scaling_config=train.ScalingConfig(num_workers=1), run_config=run_config
    )
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        assert trainer.fit().metrics == {"secret_metric": 42}
    warned = [r.getMessage() for r in caplog.records if "without the sticky bit" in r.getMessage()]
    assert len(warned) == 1 and f"chmod +t {storage}" in warned[0], warned
    storage.chmod(0o1777)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        trainer.fit()
    assert not [r for r in caplog.records if "sticky" in r.getMessage()]
    assert (storage / "run").stat().st_mode & 0o777 == 0o700


# ----------------------------------------------------------------- copies in /tmp

_READ = """
import sys
import tempfile
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as f:
            print(path, "READ", f.read().decode(errors="replace"))
    except OSError as exc:
        print(path, type(exc).__name__)
"""


def test_a_checkpoints_copy_in_tmp_is_private(other_user: OtherUser, tmp_path: Path) -> None:
    """``Checkpoint.to_directory()`` copied a checkpoint of a private (0700) run folder into
    /tmp with the checkpoint's own modes (0755, files 0644): every user could read the model."""
    import ddptrain as train

    run = tmp_path / "run"
    (run / "checkpoint_000001" / "sub").mkdir(parents=True)
    run.chmod(0o700)
    (run / "checkpoint_000001").chmod(0o755)
    for name in ("weights.bin", "sub/optimizer.bin"):
        (run / "checkpoint_000001" / name).write_text("secret weights")
        (run / "checkpoint_000001" / name).chmod(0o644)
    copy = Path(train.Checkpoint.from_directory(run / "checkpoint_000001").to_directory())
    try:
        assert copy.parent == Path(tempfile.gettempdir())
        assert (copy / "sub" / "optimizer.bin").read_text() == "secret weights"
        found = other_user.run(_READ, str(copy / "weights.bin"), str(copy / "sub" / "optimizer.bin"))
        assert "READ" not in found and found.count("PermissionError") == 2, found
        assert copy.stat().st_mode & 0o777 == 0o700
        assert not list(copy.parent.glob(f".{copy.name}*"))  # no lock or marker left beside it
    finally:
        shutil.rmtree(copy)


# ----------------------------------------------------------------- locks

_HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644)  # read access is enough for a flock
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_another_user_cannot_hold_the_data_creation_lock(
    other_user: OtherUser, shared_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TorchTrainer(serialize_data_creation=True)``'s machine-wide lock was a file in /tmp
    under a name anyone can predict: another user who took it first made the user's workers
    wait forever. It is in a private folder now; one that another user created first fails
    with a message that says to remove it."""
    from filelock import Timeout

    from ddptrain.storage.ownership import ForeignFolderError
    from ddptrain.util.sgd.torch import _creators

    monkeypatch.setattr(tempfile, "tempdir", str(shared_folder))  # /tmp, as far as ddptrain knows
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(_creators, "_lock", None)
    holder = other_user.start(_HOLD_LOCK, str(shared_folder / f".ddptrain_sgd_data_creator_{os.getuid()}.lock"))
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        lock = _creators.data_creation_lock()
        try:
            lock.acquire(timeout=5)
        except Timeout:
            pytest.fail("another user's process holds the data creation lock")
        lock.release()
    finally:
        holder.communicate(timeout=30)
    shutil.rmtree(shared_folder / f"ddptrain-private-{os.getuid()}")
    other_user.run(
        "import os, sys; os.mkdir(sys.argv[1], 0o777)", str(shared_folder / f"ddptrain-private-{os.getuid()}")
    )
    monkeypatch.setattr(_creators, "_lock", None)
    with pytest.raises(
        ForeignFolderError, match=rf"ddptrain-private-{os.getuid()} is not a private folder of yours .*Remove it"
    ):
        _creators.data_creation_lock()
