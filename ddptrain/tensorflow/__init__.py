"""TensorFlow support under Ray Train's names: change ``ray.train.tensorflow`` to
``ddptrain.tensorflow``.

``TensorflowTrainer`` gives each worker the ``TF_CONFIG`` of
``tf.distribute.MultiWorkerMirroredStrategy``; ``ddptrain.tensorflow.keras`` holds the Keras
callback that reports metrics and checkpoints. Workers run Keras 2 (``tf-keras``, with
``TF_USE_LEGACY_KERAS=1``): Keras 3 cannot train under that strategy. Importing this package
does not import TensorFlow.
"""

from ddptrain.tensorflow.config import _missing_packages

_missing = _missing_packages()
if _missing:
    raise ImportError(
        f"ddptrain.tensorflow needs {' and '.join(_missing)}, which this Python cannot import: "
        "`pip install ddptrain[tensorflow]` (TensorFlow with tf-keras)."
    )

from ddptrain.tensorflow.config import PortInUseError, TensorflowConfig  # noqa: E402
from ddptrain.tensorflow.tensorflow_checkpoint import TensorflowCheckpoint  # noqa: E402
from ddptrain.tensorflow.tensorflow_trainer import TensorflowTrainer  # noqa: E402
from ddptrain.tensorflow.train_loop_utils import prepare_dataset_shard  # noqa: E402

__all__ = [
    "PortInUseError",
    "TensorflowCheckpoint",
    "TensorflowConfig",
    "TensorflowTrainer",
    "prepare_dataset_shard",
]
