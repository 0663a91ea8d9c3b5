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
from ddptrain import channel


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
