"""Checks the configuration dataclasses share (``ddptrain.config``, ``ddptrain.scaling_config``,
``ddptrain.tune``): each raises a :class:`~ddptrain.errors.ConfigError` that names the field,
what was given, and what to do."""

from __future__ import annotations

from typing import Any

from ddptrain.errors import ConfigError

__all__ = ["DEPRECATED", "check_int", "refuse_deprecated"]

# The default of a field Ray Train V2 removed: anything else given for it is refused.
DEPRECATED = "DEPRECATED"


def check_int(name: str, value: Any, minimum: int) -> None:
    """Refuse ``value`` for the field ``name`` unless it is an integer (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"`{name}` must be an integer, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ConfigError(f"`{name}` must be >= {minimum}, got {value}.")


def refuse_deprecated(owner: str, name: str, value: Any, hint: str) -> None:
    """Refuse a field Ray Train V2 removed (``owner(name=...)``) when it was given; ``hint``
    says what to do instead."""
    if value != DEPRECATED:
        raise DeprecationWarning(f"`{owner}({name}=...)` is not supported (as in Ray Train V2). {hint}")
