"""A RaySGD program with TorchTrainer(use_local=True) whose rank 0 reads the driver's stdin
and stops in pdb there (tests/test_raysgd.py feeds both through a pipe)."""

import os
import pdb
import sys
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ddptrain import WorkerGroupError
from ddptrain.util.sgd import TorchTrainer, TrainingOperator


class DebuggedOperator(TrainingOperator):
    def setup(self, config):
        self.pid = os.getpid()
        self.line = sys.stdin.readline().strip() if self.world_rank == 0 else None
        if self.world_rank == 0:
            answer = 6 * 7
            pdb.Pdb(nosigint=True).set_trace()  # the test types "p answer" and "c"
            del answer
        torch.manual_seed(self.world_rank)
        model = nn.Linear(1, 1)
        self.register(models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.MSELoss())
        x = torch.arange(8.0).reshape(-1, 1)
        self.register_data(train_loader=DataLoader(TensorDataset(x, 2 * x), batch_size=2))
        self.fail = False

    def train_batch(self, batch, batch_info):
        if self.fail and self.world_rank == 1:  # rank 0 is then waiting for it in DDP's all-reduce
            raise ValueError("rank 1 failed on purpose")
        return super().train_batch(batch, batch_info)


if __name__ == "__main__":
    trainer = TorchTrainer(training_operator_cls=DebuggedOperator, num_workers=2, use_local=True)
    try:
        print("driver pid", os.getpid(), flush=True)
        print("pids", trainer.apply_all_operators(lambda op: op.pid), flush=True)
        print("lines", trainer.apply_all_operators(lambda op: op.line), flush=True)
        stats = trainer.train()
        weights = trainer.apply_all_operators(lambda op: [p.detach().tolist() for p in op.model.parameters()])
        print("trained", stats["num_samples"], "ranks agree", weights[0] == weights[1], flush=True)
        trainer.apply_all_operators(lambda op: setattr(op, "fail", True))
        started = time.monotonic()
        try:
            trainer.train()
        except WorkerGroupError as exc:
            seconds = time.monotonic() - started
            print(f"failed after {seconds:.0f} s:", "rank 1 failed on purpose" in str(exc), flush=True)
    finally:
        trainer.shutdown()
