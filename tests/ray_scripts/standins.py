"""Stand-ins for what the Ray quickstarts take from torchvision (whose wheel does not load with
the CPU build of torch here) and for the dataset they download: same call signatures, tiny."""

import torch


def resnet18(num_classes: int = 1000) -> torch.nn.Module:
    """A small convolutional classifier with a replaceable ``conv1``, like torchvision's."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
            self.pool = torch.nn.AdaptiveAvgPool2d(1)
            self.fc = torch.nn.Linear(64, num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.pool(torch.relu(self.conv1(x))).flatten(1))

    return Net()


class FashionMNIST(torch.utils.data.Dataset):
    """256 random 28x28 grey images with labels 0-9 (no download)."""

    def __init__(self, root: str, train: bool = True, download: bool = False, transform=None) -> None:
        generator = torch.Generator().manual_seed(0 if train else 1)
        self.images = torch.rand(256, 1, 28, 28, generator=generator)
        self.labels = torch.randint(0, 10, (256,), generator=generator)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        image = self.images[i]
        return (self.transform(image) if self.transform else image), int(self.labels[i])


class ToTensor:
    def __call__(self, x):
        return x


class Normalize:
    def __init__(self, mean, std) -> None:
        self.mean, self.std = mean[0], std[0]

    def __call__(self, x):
        return (x - self.mean) / self.std


class Compose:
    def __init__(self, steps) -> None:
        self.steps = steps

    def __call__(self, x):
        for step in self.steps:
            x = step(x)
        return x
