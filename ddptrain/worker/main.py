"""The worker process: connect to the driver's store, run commands, run the training function.

A worker is forked by its host's agent (``ddptrain.agent.main``) and then obeys the driver:
``execute`` (backend hooks such as process-group setup), ``train`` (the user's function),
``exit``. A failure of the training function is written to the status pipe, which the
agent relays to the driver together with the exit code, and the worker exits with code 1.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import io
import logging
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import cloudpickle

from ddptrain import _env, context
from ddptrain.data.ingest import open_shards
from ddptrain.errors import ConfigError, exception_to_bytes
from ddptrain.storage.open import resume_checkpoint, worker_storage
from ddptrain.wire import channel, protocol
from ddptrain.wire.boot import load_user, write_all
from ddptrain.worker import reports

__all__ = ["reopen_std_streams", "restore_blas_threads", "run"]

_logger = logging.getLogger(__name__)


def reopen_std_streams() -> None:
    """Line-buffered ``sys.stdout``/``sys.stderr`` on fds 1 and 2 (the agent's pipes)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
            write_through=True,
        )
        setattr(sys, name, stream)


def restore_blas_threads() -> None:
    """Give numpy's OpenBLAS the thread count this worker's environment asks for.

    The agent loads OpenBLAS with one thread (its pool would make the agent unsafe to fork);
    OpenBLAS reads ``OPENBLAS_NUM_THREADS``, ``GOTO_NUM_THREADS`` or ``OMP_NUM_THREADS`` and
    otherwise uses every core.
    """
    raw = next(
        (os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS") if os.environ.get(k)),
        None,
    )
    try:
        wanted = int(raw) if raw else (os.cpu_count() or 1)
    except ValueError:
        return
    if wanted <= 1:
        return
    import ctypes

    with open("/proc/self/maps") as f:
        libraries = {line.split()[-1] for line in f if "openblas" in line.rsplit("/", 1)[-1]}
    for path in libraries:
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            setter = getattr(library, symbol, None)
            if setter is not None:
                setter(ctypes.c_int(wanted))
                break


def _see_own_gpus() -> None:
    """For backends other than torch's, each worker sees only its own GPUs (as in Ray): narrow
    ``CUDA_VISIBLE_DEVICES`` to them before anything here uses CUDA. The plan numbered them
    among the GPUs the host lets the run see, and numbers them from 0 for ``get_devices()``."""
    own = os.environ.pop(_env.OWN_GPUS, None)
    if own is None:
        return
    indices = [int(index) for index in own.split(",")]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        os.environ["CUDA_VISIBLE_DEVICES"] = own
        return
    ids = [entry.strip() for entry in visible.split(",") if entry.strip()]  # "": no GPU at all
    if max(indices) >= len(ids):
        raise ConfigError(
            f"this worker was given GPU(s) {indices} of host {socket.gethostname()!r}, but its "
            f"CUDA_VISIBLE_DEVICES={visible!r} lists {len(ids)}. Lower `slots=` or the number of workers."
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[index] for index in indices)


def _check_cuda_usable(spec: protocol.WorkerSpec) -> None:
    """A GPU worker must be able to initialize CUDA: fail here, before the user's code, if not."""
    if not spec.devices:
        return
    import torch

    if torch.cuda._is_in_bad_fork():
        raise RuntimeError(
            "CUDA cannot be used in this worker: it was initialized in the ddptrain agent before the "
            "worker was forked (the training function, its config or a module it imports touched CUDA "
            "while the agent loaded it). GPU runs start workers the clean way unless "
            "DDPTRAIN_WORKER_START=shared is set; unset it, or keep CUDA calls out of module top level."
        )


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # ddptrain/


def user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` without ddptrain's own frames at the top of the stack."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def failure_record(exc: BaseException) -> protocol.FailureRecord:
    """What the driver needs to explain an exception raised in this worker."""
    return protocol.FailureRecord(
        time=time.time(),
        type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=str(exc),
        traceback=user_traceback(exc),
        exception=exception_to_bytes(exc),
    )


def _write_status(status_fd: int, record: protocol.FailureRecord) -> None:

    write_all(status_fd, cloudpickle.dumps(record))


def _setup_logging(level: str) -> None:
    logger = logging.getLogger("ddptrain")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def _make_session(spec: protocol.WorkerSpec, run: protocol.RunInfo, ch: channel.WorkerChannel) -> context._Session:
    """This worker's session in ``run`` (an empty one: a group that runs functions); its
    reports go through ``ch``."""
    checkpoint = resume_checkpoint(run.storage)
    shards = open_shards(spec.datasets)  # maps the driver's shared memory
    storage = worker_storage(run.storage, run.name) if run.storage.run_dir else None
    return context.build_session(
        run, spec, reports.CHANNEL_REPORTS, dataset_shards=shards, checkpoint=checkpoint, storage=storage, channel=ch
    )


# This worker's spec, the channel to the driver, and the user's function of the current run.
_state: dict[str, Any] = {}


def begin_run(run: protocol.RunInfo, payload: bytes | None, datasets: dict[int, Any] | None, master_port: int) -> None:
    """Switch a warm worker to a new run (called by the driver through ``execute``).

    Args:
        run: What the worker needs to know of the run (``Run.run_info``).
        payload: The run's pickled training function and config.
        datasets: Every rank's dataset shard specs; this worker takes its own.
        master_port: The port of the store the run's process group meets at (a fresh one:
            torch would find an earlier group's addresses in the old one).
    """
    spec: protocol.WorkerSpec = _state["spec"]
    spec = dataclasses.replace(spec, datasets=(datasets or {}).get(spec.rank, {}))
    os.environ["MASTER_PORT"] = str(master_port)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(run.attempt)
    sys.argv = list(run.argv or sys.argv)
    logging.getLogger("ddptrain").setLevel(run.log_level)
    _state["user"] = load_user(payload) if payload is not None else None
    context._set_session(_make_session(spec, run, _state["channel"]))


class _ToHostPickler(cloudpickle.Pickler):
    """Pickles what a worker hands back to the driver, with tensors on a GPU copied to host
    memory: the driver of a host list may have no GPU at all (unpickling would fail after
    training succeeded), and one that has should not open a CUDA context for a return value."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            host = obj.detach().cpu()
            if isinstance(obj, torch.nn.Parameter):
                host = torch.nn.Parameter(host, requires_grad=obj.requires_grad)
            return host.__reduce_ex__(self.proto)
        return super().reducer_override(obj)


def dumps_to_host(value: Any) -> bytes:
    """``cloudpickle.dumps(value)``, with GPU tensors arriving on the driver's CPU."""
    buffer = io.BytesIO()
    _ToHostPickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
    return buffer.getvalue()


def _on_notice(notice: Any) -> None:
    """A notice of the driver's, read by the heartbeat thread while the function runs."""
    if isinstance(notice, protocol.Preempt):
        info = context.PreemptionInfo(notice.deadline_ms, dict(notice.node_to_ranks), notice.reason)
        context._set_preemption(info)
        _logger.warning("ddptrain rank %d: preemption notice (%s)", _state["spec"].rank, notice.reason)
    else:
        _logger.warning("ddptrain: unknown notice %r ignored", notice)


def _execute(ch: channel.WorkerChannel, command: protocol.Execute) -> None:
    try:
        value = command.fn(*command.args, **command.kwargs)
        ch.send(protocol.CallResult(ch.rank, command.call_id, True, dumps_to_host(value)))
    except Exception as exc:
        ch.send(protocol.CallResult(ch.rank, command.call_id, False, failure_record(exc)))


def _train(user: dict[str, Any]) -> Any:
    fn = user["train_fn"]
    backend_config = user["backend_config"]
    failed = True
    try:
        with backend_config.train_func_context():
            value = fn(user["train_loop_config"]) if user["takes_config"] else fn()
        if context._session is not None:
            reports.finish_uploads(context._session)  # the run is done once its checkpoints are
        failed = False
        return value
    finally:
        if context._session is not None:
            context.run_end_hooks(context._session, failed)


def _leave_process_group() -> None:
    """A rank that returned takes no part in collectives any more: close its gloo connections
    now, so that a peer still waiting for it in one fails at once instead of after gloo's
    timeout (30 minutes by default)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


@dataclass(frozen=True)
class WorkerBoot:
    """What the agent hands every worker it forks.

    Attributes:
        run: The run the worker takes part in (empty for a group that only runs functions).
        store: Where the driver's store is, and the run's secret.
        payload: The pickled training function and its config (``None``: no run yet).
        user: The same, already loaded by the agent before it forked (the shared start), or
            ``None``: the worker loads ``payload`` itself (the clean start).
    """

    run: protocol.RunInfo
    store: protocol.StoreAddress
    payload: bytes | None
    user: dict[str, Any] | None = None


def run(spec: protocol.WorkerSpec, boot: WorkerBoot, status_fd: int) -> int:
    """Run one worker to completion; returns its exit code."""
    run_info, address = boot.run, boot.store
    # `ddptrain stack` and the driver's stall warnings ask for every thread's stack this way.
    # SIGUSR1 and SIGUSR2 stay ignored, as in the agent: SLURM may send them to every process.
    faulthandler.register(protocol.STACK_SIGNAL, file=sys.stderr, all_threads=True)
    os.environ.update(spec.env)
    restore_blas_threads()
    sys.argv = list(run_info.argv or sys.argv)
    _setup_logging(run_info.log_level)
    rank = spec.rank
    try:
        _see_own_gpus()
        _check_cuda_usable(spec)
        if boot.user is not None:
            user = boot.user
        elif boot.payload is not None:
            user = load_user(boot.payload)
        else:
            user = None  # a group that runs functions until it is given a run
        _state.update(spec=spec, user=user)
        store = channel.connect(address.host, address.port, address.connect_timeout_s)
        store.set_timeout(channel._LONG_WAIT)
        keys = channel.Keys(address.secret)
        ch = channel.WorkerChannel(store, keys, address.secret, rank)
        _state["channel"] = ch
        context._set_session(_make_session(spec, run_info, ch))
        ch.on_notice = _on_notice
        ch.send(protocol.Hello(rank, os.getpid(), socket.gethostname()))
        ch.start_heartbeat(address.host, address.port)
    except BaseException as exc:
        _write_status(status_fd, failure_record(exc))
        return 1
    while True:
        command = ch.recv()
        if isinstance(command, protocol.Execute):
            _execute(ch, command)
        elif isinstance(command, protocol.BeginRun):
            args = (command.run, command.payload, command.datasets, command.master_port)
            _execute(ch, protocol.Execute(command.call_id, begin_run, args))
        elif isinstance(command, protocol.Train):
            try:
                value = _train(_state["user"])
                _leave_process_group()
            except BaseException as exc:
                record = failure_record(exc)
                sys.stderr.write(record.traceback)
                _write_status(status_fd, record)
                return 1
            try:
                returned = dumps_to_host(value)
                note = None
            except Exception as exc:
                returned, note = None, f"the return value of rank {rank} could not be pickled: {exc!r}"
            ch.send(protocol.Done(rank, returned, note))
        elif isinstance(command, protocol.Exit):
            return 0
        else:
            _logger.warning("ddptrain rank %d: unknown command %r ignored", rank, command)
