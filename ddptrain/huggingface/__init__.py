"""Hugging Face integrations (``ddptrain.huggingface.transformers``); nothing is imported here.

``TransformersTrainer`` is here too, where Ray 2.6 had it (``ray.train.huggingface``); it
imports ``transformers`` only in the workers.
"""

from ddptrain.huggingface.transformers_trainer import TransformersTrainer

__all__ = ["TransformersTrainer"]
