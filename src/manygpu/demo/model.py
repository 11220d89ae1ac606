"""The classic two-convolution SimpleCNN (PyTorch's MNIST example) with a classifier head."""

from __future__ import annotations

import torch
from torch import nn


class SimpleCNN(nn.Module):
    """conv(32) -> conv(64) -> max-pool -> dropout -> fc(128) -> dropout -> fc(classes)."""

    def __init__(self, image_size: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=3),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
        )
        side = (image_size - 4) // 2
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * side * side, 128),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(128, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
