"""Search algorithms: how the configs of a sweep's trials are chosen.

``BasicVariantGenerator`` (grid and random search) is the default;
``ddptrain.tune.search.optuna.OptunaSearch`` wraps Optuna (``pip install "ddptrain[tune]"``).
"""

from ddptrain.tune.search.basic_variant import BasicVariantGenerator
from ddptrain.tune.search.searcher import Searcher

__all__ = ["BasicVariantGenerator", "Searcher"]
