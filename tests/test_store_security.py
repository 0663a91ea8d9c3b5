"""The driver's store: who can reach it, what can be learned about it, replays, lost and large
messages. Real stores, real workers."""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
from pathlib import Path

import pytest
from forked_driver import ForkedDriver

import ddptrain as train
from ddptrain.wire import channel, protocol


def _listen_addresses(port: int) -> list[str]:
    """Local addresses of the sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if fields[3] != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(socket.inet_ntop(family, raw))
    return found


def store_facts() -> dict:
    from ddptrain import context

    session = context._session
    assert session is not None and session.channel is not None
    return {
        "listen": _listen_addresses(int(os.environ["MASTER_PORT"])),
        "prefix": session.channel.keys.prefix,
    }


def test_a_local_runs_store_listens_on_loopback_only_under_unguessable_names(storage: str) -> None:
    result = train.DataParallelTrainer(
        store_facts,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="private", storage_path=storage),
    ).fit()
    facts = result.return_values[0]
    assert facts["listen"] == ["127.0.0.1"]
    # Nothing in the run directory names the store's queues.
    prefix = facts["prefix"].encode()
    for path in Path(storage, "private").rglob("*"):
        if path.is_file():
            assert prefix not in path.read_bytes(), path
            assert prefix.split(b"/")[-1] not in path.read_bytes(), path


def replay_a_report() -> None:
    from ddptrain import context

    train.report({"step": 0})
    session = context._session
    assert session is not None and session.channel is not None
    ch = session.channel
    if ch.rank == 0:
        # What someone who copied report #1 off the store would push again: a valid signature,
        # an old number.
        old = channel.sign(ch.secret, ch.keys.to_driver, ("report", 0, 0, {"step": 0}, None, None), number=1)
        ch.store.queue_push(ch.keys.to_driver, old)
    train.report({"step": 1})


def test_a_replayed_message_is_rejected(storage: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        result = train.DataParallelTrainer(
            replay_a_report,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="replay", storage_path=storage),
        ).fit()
    assert result.metrics_history == [{"step": 0}, {"step": 1}]
    assert len(Path(storage, "replay", "metrics.jsonl").read_text().splitlines()) == 2
    assert any("replayed" in r.getMessage() for r in caplog.records)


def lose_a_report() -> None:
    from ddptrain import context

    session = context._session
    assert session is not None and session.channel is not None
    ch = session.channel
    train.report({"step": 0})
    if ch.rank == 1:
        # As if someone had popped rank 1's next message off the store.
        ch._outbox._numbers[ch.keys.to_driver] += 1
    train.report({"step": 1})


def test_a_message_removed_from_the_store_fails_the_run(storage: str) -> None:
    with pytest.raises(train.TrainingFailedError, match=r"(?s)rank 1.*from rank 1 never arrived"):
        train.DataParallelTrainer(
            lose_a_report,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()


def test_inbox_checks_order_and_joins_large_messages() -> None:
    store = channel.open_store("127.0.0.1")
    secret = secrets.token_bytes(32)
    key = channel.Keys(secret).to_driver
    client = channel.connect("127.0.0.1", store.port, timeout_s=10)
    outbox, inbox = channel.Outbox(client, secret, 3), channel.Inbox(store, secret, key)
    big = os.urandom(20 * 2**20)
    outbox.push(key, {"small": 1})
    outbox.push(key, big)
    assert inbox.pop() == {"small": 1}
    assert inbox.pop() == big
    assert store.num_keys() <= 2  # the pieces of the large message were deleted
    # a replay of message #0
    store.queue_push(key, channel.sign(secret, key, {"small": 1}, sender=3, number=0))
    with pytest.raises(channel.ForgedMessageError, match="replayed"):
        inbox.pop()
    # a gap: #2 never came
    store.queue_push(key, channel.sign(secret, key, "late", sender=3, number=3))
    with pytest.raises(channel.LostMessageError, match=r"#2..#2 from rank 3 never arrived"):
        inbox.pop()
    other = channel.open_store("0.0.0.0")
    assert _listen_addresses(other.port) == ["0.0.0.0"]
    assert _listen_addresses(store.port) == ["127.0.0.1"]


def large_messages() -> int:
    import ddptrain.collective

    rank = train.get_context().get_world_rank()
    blob = ddptrain.collective.broadcast_from_rank_zero(os.urandom(20 * 2**20) if rank == 0 else None)
    train.report({"big": "x" * (50 * 2**20), "rank": rank})
    train.report({"after": True})
    return len(blob)


def big_return_value() -> bytes:
    return b"r" * (20 * 2**20)


@pytest.mark.timeout(240)
def test_large_return_values_metrics_and_broadcasts_get_through(storage: str) -> None:
    result = train.DataParallelTrainer(
        large_messages,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="large", storage_path=storage),
    ).fit()
    assert result.return_values == [20 * 2**20, 20 * 2**20]
    assert len(result.metrics_history[0]["big"]) == 50 * 2**20
    assert result.metrics == {"after": True}
    result = train.DataParallelTrainer(
        big_return_value,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="returns", storage_path=storage),
    ).fit()
    assert result.return_value == b"r" * (20 * 2**20)


# ----------------------------------------------------------------- the run directory


def slow_steps(config: dict) -> None:
    import time

    for step in range(config["steps"]):
        train.report({"step": step})
        time.sleep(0.2)


def test_private_run_files_are_0600_in_a_0700_folder(storage: str) -> None:
    old = os.umask(0o022)
    try:
        train.DataParallelTrainer(
            slow_steps,
            train_loop_config={"steps": 1, "api_key": "sk-secret"},
            scaling_config=train.ScalingConfig(num_workers=1),
            run_config=train.RunConfig(name="modes", storage_path=storage),
        ).fit()
    finally:
        os.umask(old)
    run = Path(storage, "modes")
    assert run.stat().st_mode & 0o777 == 0o700
    for name in ("run.json", "trainer.pkl"):
        assert (run / name).stat().st_mode & 0o777 == 0o600, name


def test_a_second_driver_on_a_live_run_fails_at_once_naming_it(storage: str, tmp_path: Path) -> None:
    import time

    script = tmp_path / "live.py"
    script.write_text(
        "import sys\n"
        "import ddptrain as train\n"
        "from test_store_security import slow_steps\n"
        "if __name__ == '__main__':\n"
        "    train.DataParallelTrainer(slow_steps, train_loop_config={'steps': 300},\n"
        "        scaling_config=train.ScalingConfig(num_workers=1),\n"
        "        run_config=train.RunConfig(name='live', storage_path=sys.argv[1])).fit()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
    live = ForkedDriver(script, [storage], env=env, stdout="devnull", stderr="devnull")  # a driver of its own, forked
    try:
        metrics = Path(storage, "live", "metrics.jsonl")
        deadline = time.monotonic() + 60
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metrics.exists()
        start = time.monotonic()
        with pytest.raises(
            train.DdpTrainError, match=rf"'live' .* in use by a live driver \(host .*, pid {live.pid}, started "
        ):
            train.DataParallelTrainer(
                slow_steps,
                train_loop_config={"steps": 1},
                scaling_config=train.ScalingConfig(num_workers=1),
                run_config=train.RunConfig(name="live", storage_path=storage),
            ).fit()
        assert time.monotonic() - start < 5
        lines = metrics.read_text().count("\n")
        time.sleep(0.5)
        assert metrics.read_text().count("\n") > lines  # the live run goes on, untouched
        assert live.poll() is None
    finally:
        live.kill()
        live.wait()
    # The dead driver's lock is taken over: the same run resumes.
    train.DataParallelTrainer(
        slow_steps,
        train_loop_config={"steps": 1},
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(name="live", storage_path=storage),
    ).fit()


def lose_the_last_message() -> str:
    from ddptrain import context

    session = context._session
    assert session is not None and session.channel is not None
    ch = session.channel
    if ch.rank == 1:
        push = ch._outbox.push

        def push_all_but_done(key: str, obj, **kwargs) -> None:
            if isinstance(obj, protocol.Done):  # pushed, and popped off the store by someone else at once
                ch._outbox._numbers[key] += 1
                ch._outbox._pushed[key] = ch._outbox._numbers[key]
                return
            push(key, obj, **kwargs)

        ch._outbox.push = push_all_but_done  # type: ignore[method-assign]
    return "returned"


@pytest.mark.timeout(60)
def test_a_removed_last_message_fails_the_run_within_a_heartbeat(storage: str) -> None:
    import time

    start = time.monotonic()
    with pytest.raises(train.TrainingFailedError, match=r"from rank 1 never arrived"):
        train.DataParallelTrainer(
            lose_the_last_message,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage),
        ).fit()
    assert time.monotonic() - start < 20


# ----------------------------------------------------------------- a local attacker on the store
# Another user of the machine connects to the driver's store like any client (a real TCPStore
# client in a thread of the test). The worker tells it the store's address; where a test needs
# the run's secret names too, that is said, since nothing on the store gives them away any more.


def _leak(directory: str, names: bool = False) -> None:
    """Rank 0 writes what the attacker knows: the store's address (and the queue names)."""
    from ddptrain import context

    session = context._session
    assert session is not None and session.channel is not None
    if session.context.get_world_rank() != 0:
        return
    target: dict = {"host": os.environ["MASTER_ADDR"], "port": int(os.environ["MASTER_PORT"])}
    if names:
        target.update(to_driver=session.channel.keys.to_driver, prefix=session.channel.keys.prefix)
    Path(directory, "target.tmp").write_text(json.dumps(target))
    Path(directory, "target.tmp").rename(Path(directory, "target.json"))


class _Attacker:
    """Runs ``attack(store, target, stop)`` in a thread once the worker has leaked its target."""

    def __init__(self, directory: Path, attack) -> None:
        import threading

        self.directory, self.attack = directory, attack
        self.stop = threading.Event()
        self.started = threading.Event()
        self.errors: list[BaseException] = []
        self.started_at = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import datetime
        import time

        target_file = self.directory / "target.json"
        while not target_file.exists() and not self.stop.is_set():
            time.sleep(0.02)
        if self.stop.is_set():
            return
        target = json.loads(target_file.read_text())
        try:
            store = channel.connect(target["host"], target["port"], timeout_s=10)
            store.set_timeout(datetime.timedelta(seconds=0.5))  # a key may vanish between list and get
            self.started_at = time.monotonic()
            self.started.set()
            (self.directory / "attacking").touch()
            self.attack(store, target, self.stop)
        except BaseException as exc:  # the run's store went away under it: the run ended
            self.errors.append(exc)

    def __enter__(self) -> _Attacker:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join(10)


def _wait_for(path: Path, timeout_s: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def checkpoint_then_broadcasts(config: dict) -> None:
    """A committed checkpoint, then (under attack) large broadcasts and reports for a while."""
    import tempfile
    import time

    import ddptrain.collective

    rank = train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as d:
        Path(d, "weights.txt").write_text("v1")
        train.report({"step": -1}, checkpoint=train.Checkpoint.from_directory(d), checkpoint_dir_name="first")
    _leak(config["dir"])
    _wait_for(Path(config["dir"], "attacking"))
    deadline = time.monotonic() + 90
    step = 0
    while time.monotonic() < deadline:
        blob = ddptrain.collective.broadcast_from_rank_zero(os.urandom(5 * 2**20) if rank == 0 else None)
        train.report({"step": step, "size": len(blob)})
        step += 1


def _delete_every_key(store, target: dict, stop) -> None:
    import time

    while not stop.is_set():
        try:
            for key in store.list_keys():
                store.delete_key(key)
        except Exception:  # a 0.5 s timeout on a loaded machine: attack on (it once ended the attack early)
            time.sleep(0.05)


@pytest.mark.timeout(150)
def test_keys_deleted_from_the_store_fail_the_run_within_a_bound(
    storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleting whatever keys the store lists (another user needs nothing but the port) used
    to leave the driver waiting for a piece of a large message forever."""
    import time

    monkeypatch.setenv("DDPTRAIN_STORE_TAMPER_TIMEOUT_S", "3")
    with _Attacker(tmp_path, _delete_every_key) as attacker:
        with pytest.raises(train.TrainingFailedError, match=r"the store was tampered with") as failed:
            train.DataParallelTrainer(
                checkpoint_then_broadcasts,
                train_loop_config={"dir": str(tmp_path)},
                scaling_config=train.ScalingConfig(num_workers=2),
                run_config=train.RunConfig(name="deleted", storage_path=storage),
            ).fit()
        assert attacker.started.is_set()
        # The deletions must hit a key a reader waits for: on a loaded machine that took 32 s once.
        assert time.monotonic() - attacker.started_at < 60, str(failed.value)
    # What was committed before the attack is intact, and listed in the run's index.
    run = Path(storage, "deleted")
    assert (run / "first" / "weights.txt").read_text() == "v1"
    assert "first" in (run / "checkpoints.json").read_text()


def report_steadily(config: dict) -> None:
    import time

    _leak(config["dir"], names=True)
    _wait_for(Path(config["dir"], config.get("wait_for", "attacking")))
    for step in range(config["steps"]):
        train.report({"step": step})
        time.sleep(0.01)


def _flood(count: int, size: int, done: Path | None = None):
    def attack(store, target: dict, stop) -> None:
        forged = os.urandom(size)
        for _ in range(count):
            if stop.is_set():
                return
            store.queue_push(target["to_driver"], forged)
        if done is not None:
            done.touch()

    return attack


@pytest.mark.timeout(150)
def test_a_flood_of_forged_messages_neither_starves_reports_nor_floods_the_console(
    storage: str, tmp_path: Path, caplog
) -> None:
    """20,000 forged messages on the driver's queue: every report still arrives, and they are
    named in a few lines with their count (there used to be one warning per message)."""
    import time

    with caplog.at_level(logging.WARNING, logger="ddptrain"), _Attacker(tmp_path, _flood(20_000, 200)):
        start = time.monotonic()
        result = train.DataParallelTrainer(
            report_steadily,
            train_loop_config={"dir": str(tmp_path), "steps": 200},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="flooded", storage_path=storage),
        ).fit()
        took = time.monotonic() - start
    assert [m["step"] for m in result.metrics_history] == list(range(200))
    assert len(Path(storage, "flooded", "metrics.jsonl").read_text().splitlines()) == 200
    rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert 1 <= len(rejected) <= 6, rejected[:10]
    assert any("bad signature" in line for line in rejected)
    assert took < 60


@pytest.mark.timeout(150)
def test_a_flood_past_the_cap_fails_the_run_naming_it(
    storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What waits unread on the driver's queue is capped: 100 MiB of forged messages against
    a cap of 8 MiB fail the run, instead of growing the driver's memory without bound."""
    monkeypatch.setenv("DDPTRAIN_CHANNEL_MAX_UNREAD_MB", "8")
    with _Attacker(tmp_path, _flood(100, 2**20, done=tmp_path / "flooded")):
        with pytest.raises(train.TrainingFailedError, match=r"(?s)DDPTRAIN_CHANNEL_MAX_UNREAD_MB=8.*tampered"):
            train.DataParallelTrainer(
                report_steadily,
                train_loop_config={"dir": str(tmp_path), "steps": 1000, "wait_for": "flooded"},
                scaling_config=train.ScalingConfig(num_workers=2),
                run_config=train.RunConfig(name="capped", storage_path=storage),
            ).fit()


class _SlowFirstReport(train.UserCallback):
    """Holds the driver's event loop for a while at the first report, as a slow callback would."""

    def after_report(self, run_context, metrics, checkpoint) -> None:
        import time

        if metrics[0].get("step") == 0:
            time.sleep(4)


def large_reports(config: dict) -> None:
    for step in range(config["steps"]):
        train.report({"step": step, "blob": "x" * 2**20})


@pytest.mark.timeout(150)
def test_a_driver_far_behind_its_workers_fails_past_the_unread_cap(
    storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's memory for messages it has not handled yet is capped: 40 MiB of reports
    waiting behind a slow callback, against a cap of 8 MiB, fail the run naming the cap."""
    monkeypatch.setenv("DDPTRAIN_CHANNEL_MAX_UNREAD_MB", "8")
    with pytest.raises(train.TrainingFailedError, match=r"DDPTRAIN_CHANNEL_MAX_UNREAD_MB=8 allows"):
        train.DataParallelTrainer(
            large_reports,
            train_loop_config={"steps": 20},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="behind", storage_path=storage, callbacks=[_SlowFirstReport()]),
        ).fit()
    status = json.loads(Path(storage, "behind", "run.json").read_text())
    assert status["status"] == "ERRORED" and "DDPTRAIN_CHANNEL_MAX_UNREAD_MB" in status["error"]


def _steal_and_replay(store, target: dict, stop) -> None:
    """Pop whatever reaches the driver's queue, and push it back (a thief and a replayer)."""
    import torch.distributed as dist

    while not stop.is_set():
        try:
            stolen = store.queue_pop(target["to_driver"], False)
        except dist.QueueEmptyError:
            continue
        store.queue_push(target["to_driver"], stolen)


@pytest.mark.timeout(150)
def test_a_thief_on_the_drivers_queue_neither_stops_nor_robs_the_run(storage: str, tmp_path: Path) -> None:
    """Another client popping the driver's queue used to win pops against the driver's thread,
    which then exited silently (the run hung), or took reports (the run failed)."""
    with _Attacker(tmp_path, _steal_and_replay):
        result = train.DataParallelTrainer(
            report_steadily,
            train_loop_config={"dir": str(tmp_path), "steps": 100},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="robbed", storage_path=storage),
        ).fit()
    assert [m["step"] for m in result.metrics_history] == list(range(100))


def _cannot_rebuild() -> None:
    raise TypeError("this metric cannot be rebuilt here")


class _Unrebuildable:
    def __reduce__(self):  # noqa: D105
        return (_cannot_rebuild, ())


def report_an_unreadable_metric() -> None:
    import time

    train.report({"step": 0})
    train.report({"odd": _Unrebuildable()})
    time.sleep(60)  # the driver must not wait for this rank to end


@pytest.mark.timeout(150)
def test_a_message_the_driver_cannot_unpickle_fails_the_run_at_once(storage: str) -> None:
    """Unpickling a report raised something the channel thread did not expect: the thread
    stopped silently and the run hung. Now the run fails at once, naming the rank and why."""
    import time

    start = time.monotonic()
    with pytest.raises(
        train.TrainingFailedError, match=r"(?s)rank 0.*could not unpickle.*this metric cannot be rebuilt here"
    ):
        train.DataParallelTrainer(
            report_an_unreadable_metric,
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="unreadable", storage_path=storage),
        ).fit()
    assert time.monotonic() - start < 40


def large_secrets(config: dict) -> bytes:
    import ddptrain.collective

    marker = bytes.fromhex(config["marker"])
    _leak(config["dir"])
    _wait_for(Path(config["dir"], "attacking"))
    rank = train.get_context().get_world_rank()
    for _ in range(3):
        ddptrain.collective.broadcast_from_rank_zero(marker * (5 * 2**20 // len(marker)) if rank == 0 else None)
        train.report({"secret": marker.hex() * (5 * 2**20 // len(marker.hex()))})
    return marker * (5 * 2**20 // len(marker))


def _read_every_key(seen: dict):
    def attack(store, target: dict, stop) -> None:
        while not stop.is_set():
            for key in store.list_keys():
                seen.setdefault("names", set()).add(key)
                try:
                    value = store.get(key)
                except Exception:  # deleted meanwhile
                    continue
                seen.setdefault("values", []).append(value[:4096] + value[-4096:])

    return attack


@pytest.mark.timeout(150)
def test_large_messages_cannot_be_read_off_the_store(storage: str, tmp_path: Path, monkeypatch) -> None:
    """Messages over 4 MiB used to sit in plain keys, in clear, under names that gave the run's
    queue names away. Everything the store lists now is sealed, and says nothing of the queues."""
    marker = os.urandom(16)
    seen: dict = {}
    monkeypatch.setenv("DDPTRAIN_STORE_TAMPER_TIMEOUT_S", "60")
    with _Attacker(tmp_path, _read_every_key(seen)):
        result = train.DataParallelTrainer(
            large_secrets,
            train_loop_config={"dir": str(tmp_path), "marker": marker.hex()},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="sealed", storage_path=storage),
        ).fit()
    assert result.return_values[1].startswith(marker)
    assert seen.get("values"), "the attacker read nothing"
    assert not any(marker in value or marker.hex().encode() in value for value in seen["values"])
    queue_names = [name for name in seen.get("names", ()) if "to_driver" in name or "to_worker" in name]
    assert queue_names == []


# ----------------------------------------------------------------- the driver's report path


def reports_then_a_checkpoint(config: dict) -> int:
    import tempfile

    for step in range(200):
        train.report({"step": step})
    with tempfile.TemporaryDirectory() as d:
        Path(d, "weights.txt").write_text("v1")
        train.report({"step": 200}, checkpoint=train.Checkpoint.from_directory(d))
    lines = Path(config["run_dir"], "metrics.jsonl").read_text().splitlines()
    return len(lines) if json.loads(lines[-1])["metrics"] == {"step": 200} else -1


def test_reports_are_on_disk_before_their_checkpoint_is_acknowledged(storage: str) -> None:
    """The driver writes the reports that arrive together in one write, but a report's line is
    in metrics.jsonl before ``report(checkpoint=...)`` returns (its checkpoint is committed and
    acknowledged only after), with every report before it."""
    result = train.DataParallelTrainer(
        reports_then_a_checkpoint,
        train_loop_config={"run_dir": str(Path(storage, "ordered"))},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="ordered", storage_path=storage),
    ).fit()
    assert result.return_values == [201, 201]
