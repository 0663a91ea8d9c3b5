"""Ray's ``ray.util`` namespace, as far as ddptrain has it: :mod:`ddptrain.util.sgd` (RaySGD).

``import ddptrain`` never imports this package.
"""

__all__: list[str] = []
