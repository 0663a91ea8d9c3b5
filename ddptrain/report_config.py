"""What ``report()`` is given, and what it gives back: the upload and consistency modes
(Ray's ``CheckpointUploadMode``, ``CheckpointConsistencyMode``), a reported checkpoint and its
status, and the checks of ``report()``'s arguments (metrics, folder name, upload, validation)
that run before anything is sent.
"""

from __future__ import annotations

import enum
import os
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle

from ddptrain.checkpoint import Checkpoint
from ddptrain.storage import layout

__all__ = [
    "CheckpointConsistencyMode",
    "CheckpointUploadMode",
    "ReportedCheckpoint",
    "ReportedCheckpointStatus",
    "Upload",
    "check_dir_name",
    "check_metrics",
    "check_upload",
    "validation_spec",
]


class CheckpointUploadMode(enum.Enum):
    """How ``report()`` persists a checkpoint.

    Members:
        SYNC: ``report()`` returns once the checkpoint files are in the run's storage.
        ASYNC: ``report()`` returns at once; a process of the worker uploads the files, in report
            order, and the driver commits the checkpoint once every rank's files are there. The
            folder must not be changed or deleted until then (``tempfile.mkdtemp()``, not a
            ``TemporaryDirectory`` that ends with the report); it is deleted after its upload by
            default.
        NO_UPLOAD: The checkpoint already is in the run's storage (the user wrote it there):
            it is registered as it is.
    """

    SYNC = "SYNC"
    ASYNC = "ASYNC"
    NO_UPLOAD = "NO_UPLOAD"

    def default_delete_local_checkpoint_after_upload(self) -> bool:
        """What ``delete_local_checkpoint_after_upload=None`` means: ``True`` for ``ASYNC``."""
        return self is CheckpointUploadMode.ASYNC


class CheckpointConsistencyMode(enum.Enum):
    """What ``get_all_reported_checkpoints`` waits for (Ray's semantics).

    Members:
        COMMITTED: Every ``report()`` this worker made so far is processed (its checkpoint
            committed) on every rank.
        VALIDATED: That, and no validation (``ValidationConfig``) is queued or running: every
            listed checkpoint has its validated metrics. The default, as in Ray.
    """

    COMMITTED = "COMMITTED"
    VALIDATED = "VALIDATED"


class ReportedCheckpointStatus(enum.Enum):
    """State of a reported checkpoint (Ray's).

    Members:
        COMMITTED: Committed; no validation was asked for (or it never ran: the run stopped).
        PENDING_VALIDATION: Committed; its validation is queued or running.
        VALIDATED: Its validation ended: its metrics are merged in (none if it failed).
    """

    COMMITTED = "COMMITTED"
    PENDING_VALIDATION = "PENDING_VALIDATION"
    VALIDATED = "VALIDATED"


@dataclass(frozen=True)
class ReportedCheckpoint:
    """A committed checkpoint, rank 0's metrics reported with it (and its validated metrics,
    merged in), and its status."""

    checkpoint: Checkpoint
    metrics: dict[str, Any]
    status: ReportedCheckpointStatus = ReportedCheckpointStatus.COMMITTED


def _find_tensor(value: Any, path: str, depth: int = 0) -> str | None:
    import torch

    if isinstance(value, torch.Tensor):
        return path
    if depth > 8:
        return None
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = _find_tensor(item, f"{path}[{key!r}]", depth + 1)
            if found:
                return found
    elif isinstance(value, (list, tuple, set)):
        for i, item in enumerate(value):
            found = _find_tensor(item, f"{path}[{i}]", depth + 1)
            if found:
                return found
    return None


def check_metrics(metrics: Any) -> dict[str, Any]:
    if not isinstance(metrics, Mapping):
        raise TypeError(f"`metrics` must be a dict, got {type(metrics).__name__}.")
    for key in metrics:
        if not isinstance(key, str):
            raise TypeError(f"`metrics` keys must be strings, got {key!r}.")
    found = _find_tensor(metrics, "metrics")
    if found:
        raise ValueError(
            f"{found} is a torch.Tensor; metrics must not contain tensors. Convert it with "
            "`.item()` or `.tolist()`, or save tensors in the checkpoint instead."
        )
    return dict(metrics)


def check_sendable(metrics: dict[str, Any]) -> None:
    """Raise, naming the metric, when ``metrics`` cannot be pickled to the driver: otherwise the
    error is the pickler's own ("cannot pickle '_thread.lock' object") from deep in the channel,
    after the checkpoint was staged (or, with ``ASYNC``, from the upload thread)."""
    try:
        pickle.dumps(metrics, protocol=pickle.HIGHEST_PROTOCOL)
        return  # the common case: plain numbers and strings
    except Exception:
        pass
    try:
        cloudpickle.dumps(metrics)
        return
    except Exception as exc:
        error = exc
    key = next((k for k, v in metrics.items() if not _picklable(v)), None)
    where = f"metrics[{key!r}]" if key is not None else "`metrics`"
    raise TypeError(
        f"{where} cannot be sent to the driver: {error}. Report numbers, strings, lists and dicts of them; "
        "keep other objects (models, locks, clients) out of the metrics."
    ) from None


def _picklable(value: Any) -> bool:
    try:
        cloudpickle.dumps(value)
    except Exception:
        return False
    return True


def check_dir_name(name: str | None) -> None:
    """Refuse a ``checkpoint_dir_name`` that is not a plain folder name."""
    if name is not None:
        layout.check_dir_name(name)


@dataclass(frozen=True)
class Upload:
    """How a report's checkpoint is persisted (``report()``'s arguments, checked)."""

    mode: CheckpointUploadMode = CheckpointUploadMode.SYNC
    delete_local: bool = False
    upload_fn: Callable[[Checkpoint, str], Checkpoint] | None = None


def check_upload(
    checkpoint: Checkpoint | None, mode: Any, delete_local: bool | None, upload_fn: Any, run_dir: str | None
) -> Upload:
    if mode is None:
        mode = CheckpointUploadMode.SYNC
    try:
        mode = CheckpointUploadMode(getattr(mode, "value", mode))  # Ray's enum works too
    except ValueError:
        raise ValueError(
            f"`checkpoint_upload_mode` must be a CheckpointUploadMode (SYNC, ASYNC or NO_UPLOAD), got {mode!r}."
        ) from None
    if upload_fn is not None and not callable(upload_fn):
        raise TypeError(
            f"`checkpoint_upload_fn` must be a function (checkpoint, dir_name) -> Checkpoint, got {upload_fn!r}."
        )
    if upload_fn is not None and mode is CheckpointUploadMode.NO_UPLOAD:
        raise ValueError(
            "`checkpoint_upload_fn` uploads the checkpoint, `CheckpointUploadMode.NO_UPLOAD` says there is nothing "
            "to upload: pass one of them."
        )
    on_disk = checkpoint is not None and not checkpoint.is_remote
    if on_disk and mode is not CheckpointUploadMode.NO_UPLOAD and upload_fn is None:
        assert checkpoint is not None
        if not os.path.isdir(checkpoint.path):  # said on the user's line, not from the upload
            raise layout.not_a_folder(checkpoint.path)
    if delete_local is None:
        delete_local = mode.default_delete_local_checkpoint_after_upload()
    if delete_local and checkpoint is not None and run_dir:
        local, root = os.path.realpath(checkpoint.path), os.path.realpath(run_dir)
        if os.path.commonpath([local, root]) in (local, root):
            raise ValueError(
                f"`delete_local_checkpoint_after_upload=True` would delete {checkpoint.path}, which is "
                f"inside the run directory {run_dir} or contains it."
            )
    return Upload(mode, bool(delete_local), upload_fn)


def validation_spec(validates: bool, validation: Any, validate_fn: Any, validate_config: Any) -> bytes | None:
    """``report()``'s validation request, pickled for the validation process
    (``None``: none). ``validates``: the trainer has a ``ValidationConfig``."""
    if validate_fn is None and validate_config is not None:
        raise ValueError("`validate_config` is the argument of `validate_fn`: pass `validate_fn` too.")
    if validate_fn is not None:
        if validation is not False and validation is not None:
            raise ValueError(
                "Pass either `validation=...` (with the trainer's `validation_config`) or `validate_fn=...`, not both."
            )
        if not callable(validate_fn):
            raise TypeError(f"`validate_fn` must be a function (checkpoint, config) -> dict, got {validate_fn!r}.")
        request: tuple[Any, ...] = (validate_fn, () if validate_config is None else (validate_config,), None)
    elif validation is False or validation is None:
        return None
    else:
        if validation is True:
            request = (None, (), None)
        elif hasattr(validation, "fn_kwargs"):  # a ValidationTaskConfig (Ray's too)
            kwargs = validation.fn_kwargs
            if kwargs is not None and not isinstance(kwargs, Mapping):
                raise TypeError(f"`ValidationTaskConfig.fn_kwargs` must be a dict, got {kwargs!r}.")
            request = (None, (), dict(kwargs) if kwargs is not None else None)
        else:
            raise TypeError(f"`validation` must be True, False or a ValidationTaskConfig, got {validation!r}.")
        if not validates:
            raise ValueError(
                "`report(validation=...)` needs a validation function: give the trainer "
                "`validation_config=ValidationConfig(fn)` (or pass `validate_fn=` to report())."
            )
    try:
        return cloudpickle.dumps(request)
    except Exception as exc:
        raise TypeError(
            f"The validation request of this report cannot be pickled ({exc!r}): `validate_fn` and the keyword "
            "arguments must be picklable (pass paths, not open files or clients)."
        ) from exc
