"""The ``ddptrain.lightning`` classes built on the ``pytorch_lightning`` package (``import pytorch_lightning as pl``).

``ddptrain.lightning`` picks this module or its twin for the package your code uses; import from
here directly when a process has both packages and ddptrain cannot tell which one you use.
"""

from __future__ import annotations

from typing import Any

from ddptrain.lightning._impl import build_classes

__all__ = [
    "RayDDPStrategy",
    "RayDeepSpeedStrategy",
    "RayFSDPStrategy",
    "RayLightningEnvironment",
    "RayModelParallelStrategy",
    "RayTrainReportCallback",
]

_classes = build_classes("pytorch_lightning", __name__)

RayLightningEnvironment: Any = _classes["RayLightningEnvironment"]
RayDDPStrategy: Any = _classes["RayDDPStrategy"]
RayFSDPStrategy: Any = _classes["RayFSDPStrategy"]
RayDeepSpeedStrategy: Any = _classes["RayDeepSpeedStrategy"]
RayModelParallelStrategy: Any = _classes["RayModelParallelStrategy"]  # None before Lightning 2.4
RayTrainReportCallback: Any = _classes["RayTrainReportCallback"]
_ResumeCheck: Any = _classes["_ResumeCheck"]
_Trainer: Any = _classes["Trainer"]
_Callback: Any = _classes["Callback"]
