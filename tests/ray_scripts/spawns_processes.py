"""Processes that multiprocessing starts with `spawn` or `forkserver` import this script again
(as `__mp_main__`): `import ray.train` must resolve there as it does here, and in the processes
a worker's DataLoader spawns."""

import multiprocessing

import ray.train
import torch
from helper_module import Numbers, ray_train_name
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
from torch.utils.data import DataLoader


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return [ray.train.__name__, i * i]


def put_name(queue):
    queue.put(ray_train_name())


def loads_with_spawned_workers():
    loader = DataLoader(Numbers(2), batch_size=None, num_workers=1, multiprocessing_context="spawn")
    return [item for item in loader]


if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print("spawn pool:", pool.map(ray_train_name, range(2)), flush=True)
    loader = DataLoader(Squares(), batch_size=None, num_workers=2, multiprocessing_context="spawn")
    print("spawn loader:", list(loader), flush=True)
    forkserver = multiprocessing.get_context("forkserver")
    queue = forkserver.Queue()
    process = forkserver.Process(target=put_name, args=(queue,))
    process.start()
    print("forkserver process:", queue.get(timeout=60), flush=True)
    process.join(timeout=60)
    result = TorchTrainer(loads_with_spawned_workers, scaling_config=ScalingConfig(num_workers=1)).fit()
    print("a worker's spawn loader:", result.return_value, flush=True)
