# Ray Train's DataParallelTrainer examples (ray.train.data_parallel_trainer docs), verbatim
# bodies; the prints at the end show what they did.
import ray
from ray import train
from ray.train import ScalingConfig
from ray.train.data_parallel_trainer import DataParallelTrainer

def train_loop_for_worker():
    dataset_shard_for_this_worker = train.get_dataset_shard("train")

    # 3 items for 3 workers, each worker gets 1 item
    batches = list(dataset_shard_for_this_worker.iter_batches(batch_size=1))
    assert len(batches) == 1
    return batches

train_dataset = ray.data.from_items([1, 2, 3])
assert train_dataset.count() == 3
trainer = DataParallelTrainer(
    train_loop_for_worker,
    scaling_config=ScalingConfig(num_workers=3),
    datasets={"train": train_dataset},
)
result = trainer.fit()
print("each worker's batches:", result.return_values)

from dataclasses import dataclass
from ray.train.backend import Backend, BackendConfig

class MyBackend(Backend):
    def on_start(self, worker_group, backend_config):
        def set_env_var(env_var_value):
            import os
            os.environ["MY_ENV_VAR"] = env_var_value

        worker_group.execute(set_env_var, backend_config.env_var)

class MyBackendConfig(BackendConfig):
    env_var: str = "default_value"

    def backend_cls(self):
        return MyBackend

class MyTrainer(DataParallelTrainer):
    def __init__(self, train_loop_per_worker, my_backend_config:
        MyBackendConfig, **kwargs):
        super().__init__(train_loop_per_worker,
            backend_config=my_backend_config, **kwargs)

def read_env():
    import os
    return os.environ.get("MY_ENV_VAR")

ray.init()
result = MyTrainer(read_env, MyBackendConfig(), scaling_config=ScalingConfig(num_workers=2)).fit()
print("MY_ENV_VAR on the workers:", result.return_values, "initialized:", ray.is_initialized())
ray.shutdown()
