from helper_module import report_rank

from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

result = TorchTrainer(report_rank, scaling_config=ScalingConfig(num_workers=2)).fit()
print("returned:", result.return_values, "metrics:", result.metrics)
