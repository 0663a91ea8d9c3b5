"""Run an example's ``main()`` in the test process, as ``python examples/<name> <args>`` would.

A ``python example.py`` driver costs its own torch import and its own agent fork server (~10 s
of CPU here) before any worker starts; the pytest process already has both warm. The example's
functions and classes are pickled by value (cloudpickle), as they are from a script's
``__main__``, so the workers never import the example by name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import cloudpickle
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

__all__ = ["EXAMPLES", "run_example_in_process"]


def run_example_in_process(
    name: str, *args: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> str:
    """Run ``examples/<name>``'s ``main()`` with ``args`` as its command line; return its stdout
    (the driver's prints and the workers' forwarded output)."""
    path = EXAMPLES / name
    module_name = f"ddptrain_example_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "argv", [str(path), *args])  # some examples read it at import
    monkeypatch.setitem(sys.modules, module_name, module)
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    capfd.readouterr()
    try:
        module.main()
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    return capfd.readouterr().out
