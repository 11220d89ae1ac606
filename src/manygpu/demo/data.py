"""scikit-learn's handwritten digits: a real data set that ships inside a package.

1,797 8x8 images of the digits 0-9; no download. We upsample them so the CNN
has enough pixels to be worth distributing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def digits(
    image_size: int = 16, test_fraction: float = 0.2, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) datasets of normalised ``1 x image_size x image_size`` images.

    The split is stratified and seeded, so every rank builds the same one.
    scikit-learn loads here, not with the module: it takes ~2 CPU-s (pandas, scipy).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if image_size != 8:
        images = F.interpolate(
            images, size=(image_size, image_size), mode="bilinear", align_corners=False
        )
    images = (images - 0.5) / 0.5
    labels = torch.tensor(bunch.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=test_fraction, random_state=seed, stratify=bunch.target
    )
    tr, te = torch.tensor(train_idx), torch.tensor(test_idx)
    return TensorDataset(images[tr], labels[tr]), TensorDataset(images[te], labels[te])
