"""The classifiers of the model zoo (``models.zoo`` names them): PyTorch networks built from code, nothing
downloaded. Kept apart from the zoo's registry so that naming or checking a model imports no PyTorch."""

from __future__ import annotations

import torch
from torch import nn


class FedAvgCNN(nn.Module):
    """The CNN of McMahan et al. 2017 (arXiv:1602.05629, section 3) for 28x28x1 inputs.

    Two 5x5 convolutions (32 then 64 channels, 'same' padding), each followed by ReLU and 2x2 max
    pooling, a 512-unit ReLU layer and a softmax output: 1,663,370 parameters for 10 classes.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(7 * 7 * 64, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class DigitsCNN(nn.Module):
    """A small CNN for scikit-learn's 8x8 digits, with BatchNorm so integer buffers are exercised."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class Mnist1dCNN(nn.Module):
    """The CNN of the MNIST-1D paper (Greydanus 2020, arXiv:2011.14439; its repository's ``ConvBase``) for
    single-channel signals of 40 samples.

    Three 1-D convolutions of 25 channels with stride 2 and padding 1 (kernel 5, then 3 and 3: 40 → 19 →
    10 → 5 positions), each followed by ReLU, and a linear layer on the flattened 25·5 features: 5,210
    parameters for 10 classes. Kept as the paper has it (no BatchNorm, no pooling) so results compare with
    its ~94 % centralized accuracy, and so DP-SGD (Opacus) can train it.
    """

    def __init__(self, num_classes: int = 10, channels: int = 25) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, 5, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.classifier = nn.Linear(channels * 5, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class MLP(nn.Module):
    """A fully connected ReLU network on flattened inputs (784-200-200-10 is the FedAvg paper's 2NN)."""

    def __init__(self, in_features: int = 784, hidden: tuple[int, ...] = (200, 200), num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for units in hidden:
            layers += [nn.Linear(width, units), nn.ReLU()]
            width = units
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ThesisCNN(nn.Module):
    """Seed 004's CNN (the SimFedSwap thesis, §5 "Conv"), no BatchNorm: conv 3 (32) → ReLU → max-pool 2 →
    conv 3 (64) → ReLU → max-pool 2 → Linear(100) → ReLU → Linear(classes).

    ``dims`` 2 is the thesis's network on 1x8x8 digits, ``dims`` 1 its 1-D analogue (Conv1d, pool 2) on
    MNIST-1D's 1x40 signals. The thesis ran it on 28x28 MNIST and never states the padding; here every
    convolution pads by 1 ("same"), so two 2x pools fit the 8x8 digits (8 → 4 → 2; unpadded, 8 → 6 → 3 → 1
    would leave nothing for the second pool) and MNIST-1D keeps 40 → 20 → 10 positions. The thesis's softmax
    layer is left to the loss (cross-entropy on logits), as in every classifier here.
    """

    def __init__(self, dims: int, length: int, num_classes: int = 10) -> None:
        super().__init__()
        conv, pool = (nn.Conv1d, nn.MaxPool1d) if dims == 1 else (nn.Conv2d, nn.MaxPool2d)
        self.features = nn.Sequential(
            conv(1, 32, 3, padding=1), nn.ReLU(), pool(2), conv(32, 64, 3, padding=1), nn.ReLU(), pool(2)
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * (length // 4) ** dims, 100), nn.ReLU(), nn.Linear(100, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))
