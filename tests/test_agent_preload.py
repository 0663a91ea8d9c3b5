"""The agent imports, once before it forks, what DistributedDataParallel's first use would import
in every worker (``torch._dynamo``), for functions that use ddptrain's DDP helpers; other
functions' workers do not pay for it."""

from __future__ import annotations

from typing import Any

import ddptrain as train

_PROBE = """
import sys
from ddptrain.torch import prepare_model

def probe(config):
    return "torch._dynamo" in sys.modules

def probe_wrapping(config):
    prepare_model  # what the function wraps its model with (not called: the probe looks before)
    return "torch._dynamo" in sys.modules
"""


def _probe(wrap: bool) -> Any:
    namespace: dict[str, Any] = {"__name__": "not_importable_probe"}  # pickled by value, with its globals
    exec(_PROBE, namespace)
    return namespace["probe_wrapping" if wrap else "probe"]


def _loaded_at_start(storage: str, wrap: bool) -> list[bool]:
    result = train.DataParallelTrainer(
        _probe(wrap),
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(storage_path=storage),
    ).fit()
    return result.return_values


def test_workers_of_a_function_using_prepare_model_start_with_what_ddp_imports(storage: str) -> None:
    assert _loaded_at_start(storage, wrap=True) == [True, True]


def test_other_functions_workers_do_not_import_it(storage: str) -> None:
    assert _loaded_at_start(storage, wrap=False) == [False, False]
