"""The driver's store: who can reach it, what can be learned about it, replays, lost and large
messages. Real stores, real workers."""

from __future__ import annotations

import logging
import os
import secrets
import socket
from pathlib import Path

import pytest

import ddptrain as train
from ddptrain import channel, protocol


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
    import subprocess
    import sys
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
    live = subprocess.Popen(
        [sys.executable, str(script), storage], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
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
