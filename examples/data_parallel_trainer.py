"""The DataParallelTrainer examples of the Ray Train docs, on ddptrain.

1. A dataset split across workers with ``get_dataset_shard``.
2. A trainer subclass with a predefined training loop.
3. A custom ``Backend``/``BackendConfig`` that sets an environment variable on every worker.

    python examples/data_parallel_trainer.py
"""

import os

import ddptrain as train  # was: from ray import train
from ddptrain import ScalingConfig  # was: from ray.train import ScalingConfig
from ddptrain.backend import Backend, BackendConfig  # was: from ray.train.backend import ...
from ddptrain.data_parallel_trainer import DataParallelTrainer  # was: ray.train.data_parallel_trainer


# 1. Datasets -----------------------------------------------------------------------------
def train_loop_for_worker():
    dataset_shard_for_this_worker = train.get_dataset_shard("train")

    # 3 items for 3 workers, each worker gets 1 item
    batches = list(dataset_shard_for_this_worker.iter_batches(batch_size=1))
    assert len(batches) == 1
    return {column: values.tolist() for column, values in batches[0].items()}  # {"item": array([1])}


# 2. A predefined training loop ---------------------------------------------------------------
class MyDataParallelTrainer(DataParallelTrainer):
    def __init__(self, *args, **kwargs):
        predefined_train_loop_per_worker = lambda: 1  # noqa: E731 (as in the Ray docs)
        super().__init__(predefined_train_loop_per_worker, *args, **kwargs)


# 3. A custom backend -------------------------------------------------------------------------
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
    def __init__(self, train_loop_per_worker, my_backend_config: MyBackendConfig, **kwargs):
        super().__init__(train_loop_per_worker, backend_config=my_backend_config, **kwargs)


def read_my_env_var():
    return os.environ["MY_ENV_VAR"]


if __name__ == "__main__":
    train_dataset = train.data.from_items([1, 2, 3])  # was: ray.data.from_items
    assert train_dataset.count() == 3
    trainer = DataParallelTrainer(
        train_loop_for_worker,
        scaling_config=ScalingConfig(num_workers=3),
        datasets={"train": train_dataset},
    )
    result = trainer.fit()
    print("each worker's batch:", result.return_values)

    result = MyDataParallelTrainer(scaling_config=ScalingConfig(num_workers=2)).fit()
    print("predefined loop returned:", result.return_values)

    result = MyTrainer(read_my_env_var, MyBackendConfig(), scaling_config=ScalingConfig(num_workers=2)).fit()
    print("MY_ENV_VAR on the workers:", result.return_values)
