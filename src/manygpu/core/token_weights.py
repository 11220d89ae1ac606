"""``par.backward(loss, tokens=n)``: one mean over every token of the step, as one process.

A language model's loss is a mean over its tokens, and ranks and micro-steps
hold different numbers of them (padding, packing). DDP / FSDP average the
ranks and accumulation averages the micro-steps, so a token on a rank with
few tokens weighs more than one on a rank with many. With ``tokens=`` the
loss is the *sum* over this micro-step's tokens on this rank: it is
backpropagated as it is (not divided by the accumulation steps), and at the
cycle's last backward one all-reduce of the token counts gives the step's
total ``N``; every gradient is then multiplied by ``D / N``, ``D`` being the
number of data shards the strategy averaged over. The result is the gradient
of (every rank's and micro-step's loss sums) / N, before any clipping.

Ranks that read the same data (tensor-parallel peers, a pipeline's stages) count
the same tokens: the all-reduce over every rank counts each shard ``world / D``
times, which is divided out. A pipeline's ``loss_fn`` returns the sum over its
micro-batch's tokens; its schedule backpropagated those sums divided by the
micro-batches (:func:`~manygpu.strategies.abilities.backpropagated_loss_scale`),
which the rescale undoes.

Every rank joins the count's all-reduce at the end of the job's first step,
whether it was given ``tokens=`` or not: that one collective (24 bytes) tells
every rank whether the job weighs by tokens. A job that does not never
all-reduces again; one that does all-reduces every step, so ``tokens=`` on
some ranks or micro-steps only is one line on every rank, not a rank waiting
in a collective the others never join.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from manygpu.comm.collectives import all_reduce
from manygpu.errors import UsageError
from manygpu.strategies import abilities


def count_of(tokens: int | torch.Tensor) -> int:
    """``tokens`` as a count, or one line saying what it must be."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 0 or tokens.is_floating_point() or tokens.is_complex():
            raise UsageError(
                f"tokens= takes an int or a 0-d integer tensor, not a {tuple(tokens.shape)} "
                f"{tokens.dtype} tensor: the number of tokens this loss sums over"
            )
        tokens = int(tokens.item())
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise UsageError(
            f"tokens={tokens!r}: give the number of tokens the loss sums over, an int >= 0"
        )
    return tokens


class TokenWeights:
    """The token counts of the accumulation cycle under way, and the rescale at its end."""

    def __init__(self, timeout_s: float, device: torch.device) -> None:
        self._timeout_s, self._device = timeout_s, device
        self._already = 1.0  # what a schedule's own backward divided the sums by
        self._tokens = 0
        self._with = 0  # micro-steps of this cycle given tokens= ...
        self._without = 0  # ... and not
        self._weighted: bool | None = None
        """Whether this job weighs by tokens, agreed by every rank at its first step."""

    def note(self, loss: torch.Tensor, tokens: int | torch.Tensor | None, strategy: Any) -> None:
        """One micro-step's backward: its count (``None``: plain ``backward(loss)``)."""
        undecided = self._weighted is None or tokens is not None
        if undecided and isinstance(type(strategy), abilities.PlacesRanks):  # asked once
            # Parameter servers: a server never runs the loop, so no count reaches every
            # rank; their workers' gradients are combined on the servers, not averaged.
            if tokens is not None:
                raise UsageError(
                    "par.backward(loss, tokens=...) is not supported under strategy 'ps' (a "
                    "server never joins the count): divide the loss by its tokens yourself"
                )
            self._weighted = False
        if tokens is None:
            self._without += 1
            return
        if not loss.requires_grad:  # backpropagated already, by a pipeline's schedule
            scale = abilities.backpropagated_loss_scale(strategy)
            if scale is None:
                raise UsageError(
                    "par.backward(loss, tokens=...) got a loss that does not require grad: "
                    "give the loss summed over tokens, as computed from the model's output"
                )
            self._already = scale
        if loss.dim() != 0:
            raise UsageError(
                f"par.backward(loss, tokens=...) takes a scalar loss (a sum over tokens), "
                f"not a {tuple(loss.shape)} tensor: sum it first"
            )
        self._tokens += count_of(tokens)
        self._with += 1

    def end_cycle(self, models: Iterable[nn.Module], data_world: int) -> bool:
        """The cycle's last backward: when it was given ``tokens=``, every gradient scaled
        by ``data_world / N`` (then True); else nothing to do (False)."""
        tokens, given, plain = self._tokens, self._with, self._without
        self._tokens = self._with = self._without = 0
        if self._weighted is False:  # every rank said so at the first step: no collective
            if given:
                raise UsageError(
                    "par.backward(loss, tokens=...) after steps without it: give tokens= "
                    "on every backward from the first step, or on none"
                )
            return False
        # Every rank takes part, tokens or not (the first step decides for the job): a
        # rank without tokens= never leaves the others waiting in a collective of their own.
        world = dist.get_world_size() if dist.is_initialized() else 1
        counts = torch.tensor([tokens, given, plain], dtype=torch.float64, device=self._device)
        all_reduce(counts, "sum", timeout_s=self._timeout_s)
        total, given_all, plain_all = (float(v) for v in counts.tolist())
        if self._weighted is None:
            self._weighted = bool(given_all)
        if not given_all:
            return False
        if plain_all and given_all:
            raise UsageError(
                "par.backward(loss, tokens=...) was given on some micro-steps or ranks and "
                "not others in this step: give tokens= on every backward, or on none"
            )
        total /= world / data_world  # ranks reading the same data counted them alike
        if total <= 0:
            raise UsageError(
                "no rank counted any token in this step (tokens=0 everywhere): the mean loss "
                "over no tokens has no gradient; skip such a step"
            )
        _scale_grads(models, data_world * self._already / total)
        self._already = 1.0
        return True


@torch.no_grad()
def _scale_grads(models: Iterable[nn.Module], factor: float) -> None:
    seen: set[int] = set()
    for model in models:
        for p in model.parameters():
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                p.grad.mul_(factor)
