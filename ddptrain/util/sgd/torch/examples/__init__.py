"""The helpers RaySGD's documentation imports (``ray.util.sgd.torch.examples``)."""
