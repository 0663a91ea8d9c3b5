"""``TensorflowCheckpoint``: a checkpoint that holds a whole Keras model (Ray's legacy helper)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from ddptrain.checkpoint import Checkpoint
from ddptrain.tensorflow._keras import keras_module

__all__ = ["TensorflowCheckpoint"]


class TensorflowCheckpoint(Checkpoint):
    """A :class:`~ddptrain.Checkpoint` with one saved Keras model (``model.keras``).

    ``ReportCheckpointCallback`` writes checkpoints of this layout. To load the model of a
    run's checkpoint in the driver, wrap its folder:

    Example:
        >>> model = TensorflowCheckpoint.from_directory(result.checkpoint.path).get_model()
    """

    MODEL_FILENAME_KEY = "_model_filename"
    MODEL_FILENAME = "model.keras"

    @classmethod
    def from_model(cls, model: Any, *, preprocessor: Any = None) -> TensorflowCheckpoint:
        """Save ``model`` (architecture, weights and optimizer state) in a new temporary folder.

        Args:
            model: A compiled or uncompiled Keras model.
            preprocessor: Not supported (Ray Data preprocessors do not exist here).

        Returns:
            A checkpoint of the temporary folder; delete it once reported.
        """
        if preprocessor is not None:
            raise NotImplementedError("`preprocessor` is not supported by ddptrain.")
        folder = tempfile.mkdtemp(prefix="ddptrain-tf-checkpoint-")
        model.save(os.path.join(folder, cls.MODEL_FILENAME))
        checkpoint = cls(folder)
        checkpoint.update_metadata({cls.MODEL_FILENAME_KEY: cls.MODEL_FILENAME})
        return checkpoint

    def get_model(self) -> Any:
        """Load the saved model with the workers' Keras (``tf-keras`` by default).

        Raises:
            FileNotFoundError: The folder holds no saved model.
        """
        name = self.get_metadata().get(self.MODEL_FILENAME_KEY, self.MODEL_FILENAME)
        path = os.path.join(self.path, name)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{self.path} holds no Keras model ({name} is missing): it was not written by "
                "TensorflowCheckpoint.from_model or ReportCheckpointCallback."
            )
        return keras_module().models.load_model(path)
