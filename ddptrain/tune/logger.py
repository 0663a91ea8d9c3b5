"""``ray.tune.logger.pretty_print``: a result dict as the YAML block Ray prints.

Ray's version drops ``config`` (and ``hist_stats``) and every ``None``, round-trips the rest
through JSON (numpy numbers become plain ones, anything else its ``str``), and prints it with
``yaml.safe_dump(default_flow_style=False)``: keys sorted, nested dicts indented by two spaces,
lists as ``- item`` lines. This module writes the same text without needing PyYAML; strings
that would not read back as themselves are single-quoted, as PyYAML does (a long string is
kept on one line where PyYAML would fold it at 80 columns, and a string with a line break or
another unprintable character is double-quoted with escapes).

Example:
    >>> print(pretty_print({"epoch": 1, "profile": {"mean_fwd_s": 0.5}, "config": {"lr": 1}}), end="")
    epoch: 1
    profile:
      mean_fwd_s: 0.5
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Iterable
from typing import Any

__all__ = ["pretty_print"]


def pretty_print(result: dict[str, Any], exclude: Iterable[str] | None = None) -> str:
    """``result`` as YAML, without ``config``, ``hist_stats``, the keys in ``exclude``, and
    ``None`` values (Ray's ``pretty_print``)."""
    skipped = {"config", "hist_stats", *(exclude or ())}
    out = {k: v for k, v in result.items() if v is not None and k not in skipped}
    cleaned = json.loads(json.dumps(out, default=_fallback))
    return "".join(_block(cleaned, 0)) if cleaned else "{}\n"


def _fallback(value: Any) -> Any:
    """What Ray's ``SafeFallbackEncoder`` does with what JSON cannot encode: arrays become
    lists, numbers (numpy's, ``Decimal``...) plain numbers, NaN ``null``, the rest its ``str``."""
    try:
        if hasattr(value, "tolist") and hasattr(value, "ndim") and value.ndim > 0:
            return value.tolist()
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Number):
            number = float(value)  # type: ignore[arg-type]
            return None if math.isnan(number) else number
    except Exception:
        pass
    return str(value)


def _block(value: Any, indent: int) -> list[str]:
    """The lines of a non-empty dict or list at ``indent`` spaces."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key in sorted(value):
            item = value[key]
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{_scalar(key)}:\n")
                # PyYAML puts a mapping's list at the key's own indentation.
                lines += _block(item, indent if isinstance(item, list) else indent + 2)
            else:
                lines.append(f"{pad}{_scalar(key)}: {_scalar(item)}\n")
        return lines
    for item in value:
        if isinstance(item, (dict, list)) and item:
            inner = _block(item, indent + 2)
            lines.append(f"{pad}- {inner[0][indent + 2 :]}")
            lines += inner[1:]
        else:
            lines.append(f"{pad}- {_scalar(item)}\n")
    return lines


_SPECIAL_START = tuple(",[]{}#&*!|>'\"%@`")
_IMPLICIT = re.compile(
    r"""^(?:
        ~|null|Null|NULL|true|True|TRUE|false|False|FALSE|yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF
        |[-+]?(?:0|[1-9][0-9_]*)|[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?0x[0-9a-fA-F_]+|[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+
        |[-+]?(?:[0-9][0-9_]*)?\.[0-9_]*(?:[eE][-+][0-9]+)?|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
        |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)|=|<<
        |[0-9][0-9][0-9][0-9]-[0-9][0-9]?-[0-9][0-9]?.*
    )$""",
    re.X,
)


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value).lower()
        return text.replace("e", ".0e", 1) if "." not in text and "e" in text else text
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _string(str(value))


def _string(text: str) -> str:
    if not text.isprintable():
        return json.dumps(text)  # PyYAML double-quotes these, with escapes
    plain = (
        text
        and text == text.strip()
        and not text.startswith(_SPECIAL_START)
        and not (text[0] in "-?:" and (len(text) == 1 or text[1] == " "))
        and ": " not in text
        and " #" not in text
        and not text.endswith(":")
        and not _IMPLICIT.match(text)
    )
    return text if plain else "'" + text.replace("'", "''") + "'"
