"""Rank 0's progress through one epoch of the default ``TrainingOperator.train_epoch``
(``use_tqdm=True``): a tqdm bar when tqdm is installed, else a plain status line every few
seconds and one at the end, so that a long epoch never looks stuck.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sized
from typing import Any

from ddptrain.util.sgd.torch.constants import NUM_STEPS

__all__: list[str] = []

_STATUS_EVERY_S = 5.0


class EpochProgress:
    """The progress of one epoch over ``loader``: call :meth:`update` after every batch and
    :meth:`close` at the end (also when the epoch raised)."""

    def __init__(self, loader: Any, info: dict[str, Any]) -> None:
        epoch = info.get("epoch_idx")
        self.desc = f"{epoch + 1}e" if isinstance(epoch, int) else ""
        total = info.get(NUM_STEPS)
        if total is None and isinstance(loader, Sized):
            total = len(loader)
        self.total = total
        self.bar: Any = None
        self.next_line = time.monotonic() + _STATUS_EVERY_S
        self.done = 0
        self.loss: float | None = None
        try:
            from tqdm import tqdm  # optional dependency: plain lines without it
        except ImportError:
            return
        self.bar = tqdm(total=total, desc=self.desc, unit="batch", leave=False, file=sys.stderr)

    def update(self, done: int, metrics: dict[str, Any]) -> None:
        """``done`` batches so far; the last batch's ``metrics`` (its ``train_loss`` is shown)."""
        self.done = done
        self.loss = metrics.get("train_loss", self.loss)
        if self.bar is not None:
            self.bar.n = done
            if self.loss is not None:
                self.bar.set_postfix(loss=self.loss)
            else:
                self.bar.refresh()
        elif time.monotonic() >= self.next_line:
            self.next_line = time.monotonic() + _STATUS_EVERY_S
            self._line()

    def _line(self) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        loss = f" loss={self.loss:.4g}" if self.loss is not None else ""
        print(f"epoch {self.desc or '?'}: batch {self.done}{of}{loss}", flush=True)

    def close(self) -> None:
        """End the bar, or print the final status line."""
        if self.bar is not None:
            self.bar.close()
        else:
            self._line()
