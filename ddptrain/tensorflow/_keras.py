"""Which Keras the workers train with: ``tf-keras`` unless ``TF_USE_LEGACY_KERAS`` says no."""

from __future__ import annotations

import os
from types import ModuleType

from ddptrain.tensorflow.config import LEGACY_KERAS_VAR


def keras_module() -> ModuleType:
    """``tf_keras`` (Keras 2, what ``tf.keras`` is under ``TF_USE_LEGACY_KERAS=1``), or Keras 3
    when ``TF_USE_LEGACY_KERAS`` is set to something else (``0``). Imported directly, so the
    driver loads the workers' Keras without setting the variable itself."""
    value = os.environ.get(LEGACY_KERAS_VAR)
    if value is not None and value not in ("true", "True", "1"):
        import keras

        return keras
    import tf_keras

    return tf_keras
