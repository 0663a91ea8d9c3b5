"""What the XGBoost and LightGBM integrations share: the import guard that names the extra,
the reporting of a round's eval metrics with an optional model checkpoint, and finding this
worker's address.

Nothing here imports a framework; ``ddptrain.xgboost`` and ``ddptrain.lightgbm`` do.
"""

from __future__ import annotations

import importlib
import os
import socket
import tempfile
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from ddptrain.checkpoint import Checkpoint
from ddptrain.context import get_context, report

__all__: list[str] = []


def require(module: str, extra: str, minimum: tuple[int, int], what: str) -> ModuleType:
    """Import ``module`` for ``ddptrain.<extra>``, or raise an ``ImportError`` naming the extra.

    Args:
        module: The framework's module (``"xgboost"``).
        extra: ddptrain's extra that installs it (``"xgboost"``).
        minimum: The oldest ``(major, minor)`` version that works.
        what: The framework's name for messages (``"XGBoost"``).
    """
    try:
        imported = importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"ddptrain.{extra} needs {what}, which is not installed: `pip install ddptrain[{extra}]` "
            f"(or `pip install {module}>={minimum[0]}.{minimum[1]}`)."
        ) from exc
    version = str(getattr(imported, "__version__", "0"))
    if _major_minor(version) < minimum:
        raise ImportError(
            f"ddptrain.{extra} needs {what} >= {minimum[0]}.{minimum[1]}, found {version}: "
            f"`pip install -U ddptrain[{extra}]`."
        )
    return imported


def _major_minor(version: str) -> tuple[int, int]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def select_metrics(results: Mapping[str, float], metrics: list[str] | dict[str, str] | None) -> dict[str, float]:
    """The metrics to report from a round's flat results (``{"valid-logloss": 0.3}``).

    ``metrics``: ``None`` reports everything; a list picks keys; a dict renames
    ``{reported name: framework key}``. A key the round did not produce raises a ``KeyError``
    that lists the keys there are.
    """
    if not metrics:
        return dict(results)
    pairs = metrics.items() if isinstance(metrics, dict) else ((key, key) for key in metrics)
    chosen = {}
    for name, key in pairs:
        if key not in results:
            raise KeyError(
                f"RayTrainReportCallback: metric {key!r} was not computed this round; the round's "
                f"metrics are {sorted(results)}. Name one of those in `metrics`."
            )
        chosen[name] = results[key]
    return chosen


def metrics_arg(metrics: str | list[str] | dict[str, str] | None) -> list[str] | dict[str, str] | None:
    """``RayTrainReportCallback(metrics=...)`` checked: a name, a list of names or a dict."""
    if metrics is None or isinstance(metrics, dict):
        return metrics
    if isinstance(metrics, str):
        return [metrics]
    if isinstance(metrics, (list, tuple)) and all(isinstance(m, str) for m in metrics):
        return list(metrics)
    raise TypeError(
        f"`metrics` must be a metric name, a list of names or a dict {{reported name: metric key}}, got {metrics!r}."
    )


def check_frequency(frequency: int) -> int:
    if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 0:
        raise ValueError(
            f"`frequency` must be a number of rounds >= 0 (0: no periodic checkpoints), got {frequency!r}."
        )
    return frequency


def report_round(metrics: dict[str, Any], save_model: Callable[[str], None] | None) -> None:
    """``ddptrain.report`` one round from every worker; with ``save_model``, rank 0 also
    writes the model into a fresh folder (``save_model(folder)``) reported as the checkpoint."""
    if save_model is None or get_context().get_world_rank() != 0:
        report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="ddptrain-gbdt-") as folder:
        save_model(folder)
        report(metrics, checkpoint=Checkpoint.from_directory(folder))


def own_address() -> str:
    """This worker's IPv4 address as the other hosts see it: the local end of a route to the
    driver (``MASTER_ADDR``), so ``127.0.0.1`` when every worker runs on the driver's machine."""
    target = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        target = str(socket.getaddrinfo(target, None, socket.AF_INET)[0][4][0])
    except OSError:
        return "127.0.0.1"
    if target.startswith("127."):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((target, 9))  # a UDP "connect" sends nothing; it only picks the route
        return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()
