"""``ddptrain.progress.set_progress(...)``, the path docs/reference.md documents for the run's
console lines: a shim that re-exports the public names of :mod:`ddptrain.driver.progress`,
where the console lives."""

from ddptrain.driver.progress import MODES, progress_mode, quiet, set_progress

__all__ = ["MODES", "progress_mode", "quiet", "set_progress"]
