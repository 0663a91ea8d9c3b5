"""A program that uses ddptrain and wants the real `ray` (started by `starts_programs.py`)."""

import ddptrain as train
from ddptrain.torch import TorchTrainer


def which_ray():
    import ray

    return getattr(ray, "WHICH", "ddptrain's aliases")


if __name__ == "__main__":
    print("other program's ray:", which_ray(), flush=True)
    result = TorchTrainer(which_ray, scaling_config=train.ScalingConfig(num_workers=1)).fit()
    print("other program's workers' ray:", result.return_value, flush=True)
