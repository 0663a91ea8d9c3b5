"""Two models at once: a tiny GAN whose operator overrides ``train_epoch`` (RaySGD's
"simultaneous multi-model training"). The generator learns to draw from N(3, 0.5).

    python examples/raysgd_gan.py --num-workers 2 --epochs 3
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ddptrain.util.sgd import TorchTrainer
from ddptrain.util.sgd.torch import TrainingOperator
from ddptrain.util.sgd.utils import AverageMeterCollection

LATENT = 4


class GANOperator(TrainingOperator):
    def setup(self, config):
        discriminator = nn.Sequential(nn.Linear(1, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
        generator = nn.Sequential(nn.Linear(LATENT, 16), nn.ReLU(), nn.Linear(16, 1))
        d_opt = torch.optim.Adam(discriminator.parameters(), lr=config["lr"], betas=(0.5, 0.999))
        g_opt = torch.optim.Adam(generator.parameters(), lr=config["lr"], betas=(0.5, 0.999))
        self.models, self.optimizers, self.criterion = self.register(
            models=(discriminator, generator), optimizers=(d_opt, g_opt), criterion=nn.BCELoss()
        )
        real = torch.randn(4096, 1) * 0.5 + 3
        self.register_data(train_loader=DataLoader(TensorDataset(real), batch_size=128, shuffle=True))

    def train_epoch(self, iterator, info):
        discriminator, generator = self.models
        d_opt, g_opt = self.optimizers
        meters = AverageMeterCollection()
        for (real,) in iterator:
            real = real.to(self.device)
            n = real.size(0)
            ones, zeros = torch.ones(n, 1, device=self.device), torch.zeros(n, 1, device=self.device)
            fake = generator(torch.randn(n, LATENT, device=self.device))

            d_opt.zero_grad()
            real_loss = self.criterion(discriminator(real), ones)
            d_loss = (real_loss + self.criterion(discriminator(fake.detach()), zeros)) / 2
            d_loss.backward()
            d_opt.step()

            g_opt.zero_grad()
            g_loss = self.criterion(discriminator(fake), ones)
            g_loss.backward()
            g_opt.step()
            meters.update({"loss_d": d_loss.item(), "loss_g": g_loss.item(), "fake_mean": fake.mean().item()}, n=n)
        return meters.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    with TorchTrainer(training_operator_cls=GANOperator, num_workers=args.num_workers, config={"lr": 0.005}) as t:
        for _ in range(args.epochs):
            s = t.train()
            losses = f"loss_d {s['loss_d']:.3f} loss_g {s['loss_g']:.3f}"
            print(f"epoch {s['epoch']}: {losses} fake mean {s['fake_mean']:.2f}")
        discriminator, generator = t.get_model()
        print(f"models: {type(discriminator).__name__}, {type(generator).__name__}")


if __name__ == "__main__":
    main()
