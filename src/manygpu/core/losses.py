"""A loss that reports its tokens, for ``par.backward(loss, tokens=n)``.

Cross-entropy summed over the tokens whose label is not ``ignore_index`` (padding,
prompts, packed documents' boundaries), with the count of those tokens: the pair
:meth:`manygpu.Parallel.backward` takes, so a step applies one mean over every
rank's and micro-step's tokens (:mod:`manygpu.core.token_weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100, shift: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of the counted tokens' cross-entropy, their count)``.

    ``logits``: ``(..., vocab)``; ``labels``: the same leading shape. ``shift``:
    labels are the inputs, as Hugging Face causal LMs take them; position ``t``
    predicts token ``t + 1`` (the last logit and the first label drop out).
    The sum is in float32 whatever the logits' dtype (bf16 sums lose tokens).
    """
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    flat = logits.reshape(-1, logits.shape[-1]).float()
    target = labels.reshape(-1)
    loss = F.cross_entropy(flat, target, ignore_index=ignore_index, reduction="sum")
    return loss, (target != ignore_index).sum()
