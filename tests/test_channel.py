"""The store is open to anyone who can reach its port: forged messages must be rejected unread."""

from __future__ import annotations

import json
import logging
import os
import pickle
import time
from pathlib import Path

import pytest

import ddptrain as train
from ddptrain.wire import channel


def test_sign_and_verify_round_trip() -> None:
    secret = os.urandom(32)
    assert channel.verify(secret, "q", channel.sign(secret, "q", {"a": 1})) == {"a": 1}
    with pytest.raises(channel.ForgedMessageError):
        channel.verify(os.urandom(32), "q", channel.sign(secret, "q", {"a": 1}))
    with pytest.raises(channel.ForgedMessageError):
        channel.verify(secret, "q", b"short")
    tampered = bytearray(channel.sign(secret, "q", {"a": 1}))
    tampered[-2] ^= 1
    with pytest.raises(channel.ForgedMessageError):
        channel.verify(secret, "q", bytes(tampered))
    # A genuine message replayed onto another queue is refused.
    with pytest.raises(channel.ForgedMessageError):
        channel.verify(secret, "other", channel.sign(secret, "q", {"a": 1}))


class _RunsCommand:
    """Unpickling this runs a shell command: what an attacker would push."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):  # noqa: D105
        return (os.system, (self.command,))


def wait_for_attack(config: dict) -> None:
    from ddptrain import context

    session = context._session
    assert session is not None and session.channel is not None
    if train.get_context().get_world_rank() == 0:
        target = {
            "host": os.environ["MASTER_ADDR"],
            "port": int(os.environ["MASTER_PORT"]),
            "to_driver": session.channel.keys.to_driver,
            "to_worker": session.channel.keys.to_worker(1),
        }
        Path(config["dir"], "target.json").write_text(json.dumps(target))
    deadline = time.monotonic() + 30
    while not Path(config["dir"], "attacked").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    train.report({"genuine": True})


def test_forged_messages_are_rejected_before_unpickling(storage: str, tmp_path: Path, caplog) -> None:
    import threading

    pwned = tmp_path / "pwned"

    def attack() -> None:
        target_file = tmp_path / "target.json"
        while not target_file.exists():
            time.sleep(0.05)
        target = json.loads(target_file.read_text())
        store = channel.connect(target["host"], target["port"], timeout_s=10)
        evil = pickle.dumps(("report", 0, 1, {"x": _RunsCommand(f"touch {pwned}")}, None, None))
        store.queue_push(target["to_driver"], evil)  # no signature at all
        store.queue_push(target["to_driver"], os.urandom(32) + evil)  # a made-up signature
        store.queue_push(
            target["to_driver"], os.urandom(32) + pickle.dumps(("report", 0, 1, {"forged": 1}, None, None))
        )
        command = pickle.dumps(("execute", 0, (os.system, (f"touch {pwned}",), {})))
        store.queue_push(target["to_worker"], os.urandom(32) + command)  # a command to rank 1
        (tmp_path / "attacked").touch()

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        result = train.DataParallelTrainer(
            wait_for_attack,
            train_loop_config={"dir": str(tmp_path)},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(name="attacked", storage_path=storage),
        ).fit()
    attacker.join(5)

    assert not pwned.exists()
    assert result.metrics_history == [{"genuine": True}]
    assert sum("bad signature" in r.getMessage() for r in caplog.records) == 3
    rank1_log = Path(storage, "attacked", "logs", "attempt_0", "rank_1.log").read_text()
    assert "bad signature" in rank1_log


# ----------------------------------------------------------------- without worker processes
# A real store and the real channel ends, driven from this process.


def test_sealed_messages_carry_nothing_in_clear() -> None:
    """Another user who pops or reads a message off the store learns nothing from it."""
    import secrets

    secret = secrets.token_bytes(32)
    marker = os.urandom(16)
    key = channel.Keys(secret).to_worker(0)
    assert marker not in channel.sign(secret, key, {"secret": marker})
    store = channel.open_store("127.0.0.1")
    client = channel.connect("127.0.0.1", store.port, timeout_s=10)
    channel.Outbox(client, secret, channel.DRIVER).push(key, marker * (6 * 2**20 // 16))  # two parts
    stolen = [client.queue_pop(key, False) for _ in range(client.queue_len(key))]
    assert len(stolen) == 2
    assert not any(marker in part for part in stolen)


def test_rejected_messages_are_counted_not_each_logged(caplog) -> None:
    warnings = channel.RateLimitedWarnings(logging.getLogger("ddptrain.test"), "ddptrain driver", interval_s=60)
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        for _ in range(20_000):
            warnings.warn("with a bad signature", "rejected a store message of 200 bytes with a bad signature")
        warnings.flush(force=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    assert "rejected 19997 more store messages" in lines[-1] and "19997 with a bad signature" in lines[-1]


def _driver_end(world_size: int):
    import secrets

    from ddptrain.driver.group_events import GroupEvents
    from ddptrain.driver.plan import Plan
    from ddptrain.wire.driver_channel import DriverChannel

    store = channel.open_store("127.0.0.1")
    secret = secrets.token_bytes(32)
    keys = channel.Keys(secret)
    group = GroupEvents(Plan(train.ScalingConfig(num_workers=world_size)))
    group.channel = DriverChannel(store, keys, secret, world_size)
    group.channel.start(lambda batch: group.events.put(("msgs", batch)), lambda e: group.events.put(("channel", e)))
    return store, secret, keys, group


def test_a_deleted_log_key_fails_the_group_within_the_tamper_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddptrain.driver.group_events import GroupFailed
    from ddptrain.wire import protocol

    monkeypatch.setenv("DDPTRAIN_STORE_TAMPER_TIMEOUT_S", "1")
    store, secret, keys, group = _driver_end(1)
    try:
        client = channel.connect("127.0.0.1", store.port, timeout_s=10)
        worker = channel.Outbox(client, secret, 0, logs=keys)
        worker.push(keys.to_driver, protocol.Hello(0, os.getpid(), "here"))
        group.pump_until(lambda: 0 in group.connected, timeout_s=10)
        attacker = channel.connect("127.0.0.1", store.port, timeout_s=10)
        assert attacker.delete_key(keys.segment(0, 0))
        beats = channel.Outbox(client, secret, 0 | channel.BEAT_SENDER, logs=keys)
        beats.push(keys.to_driver, protocol.Beat(0, 1))  # wakes the driver, which reads every log
        start = time.monotonic()
        with pytest.raises(GroupFailed, match=r"rank 0's messages to the driver was deleted.*tampered"):
            group.pump_until(lambda: False, timeout_s=20)
        assert time.monotonic() - start < 10
    finally:
        assert group.channel is not None
        group.channel.stop()
