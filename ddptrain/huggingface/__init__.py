"""Hugging Face integrations (``ddptrain.huggingface.transformers``); nothing is imported here."""
