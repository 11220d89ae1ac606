"""``par.backward(loss, tokens=n)`` in one process: the mean over tokens, and its refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from manygpu import Parallel
from manygpu.errors import UsageError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1, bias=False)


def test_micro_steps_weigh_by_their_tokens_not_by_count() -> None:
    """2 micro-steps of 1 and 3 tokens: the gradient of the 4 tokens' mean."""
    xs = [torch.randn(1, 4), torch.randn(3, 4)]
    with Parallel(strategy="single", grad_accum_steps=2) as par:
        model = par.prepare(_model())
        for x in xs:
            par.backward(model(x).sum(), tokens=len(x))
        got = model.weight.grad.clone()
    ref = _model()
    (ref(torch.cat(xs)).sum() / 4).backward()
    assert torch.allclose(got, ref.weight.grad, atol=1e-6)


@pytest.mark.parametrize(
    ("tokens", "needle"),
    [(-1, "int >= 0"), (2.5, "int >= 0"), (True, "int >= 0"),
     (torch.tensor(2.0), "integer tensor"), (torch.tensor([1, 2]), "0-d")],
)  # fmt: skip
def test_a_bad_count_is_one_line(tokens: object, needle: str) -> None:
    with Parallel(strategy="single") as par:
        model = par.prepare(_model())
        with pytest.raises(UsageError, match=needle) as e:
            par.backward(model(torch.randn(2, 4)).sum(), tokens=tokens)  # type: ignore[arg-type]
        assert "\n" not in str(e.value)


def test_a_non_scalar_loss_and_a_mixed_cycle_are_refused() -> None:
    with Parallel(strategy="single", grad_accum_steps=2) as par:
        model = par.prepare(_model())
        with pytest.raises(UsageError, match="scalar loss"):
            par.backward(model(torch.randn(2, 4)), tokens=2)
        par.backward(model(torch.randn(2, 4)).sum(), tokens=2)
        with pytest.raises(UsageError, match="on every backward, or on none"):
            par.backward(model(torch.randn(2, 4)).sum())


def test_a_step_without_any_token_says_so() -> None:
    with Parallel(strategy="single") as par:
        model = par.prepare(_model())
        with pytest.raises(UsageError, match="no rank counted any token"):
            par.backward(model(torch.randn(2, 4)).sum() * 0, tokens=0)


def test_token_cross_entropy_is_a_hf_causal_lm_loss_times_its_tokens() -> None:
    """With ``shift=True`` the pair divides to the loss a HF causal LM computes itself."""
    pytest.importorskip("transformers")
    from zoo import hf_llama

    from manygpu import token_cross_entropy

    torch.manual_seed(0)
    model = hf_llama()
    ids = torch.randint(0, 64, (3, 8))
    labels = ids.clone()
    labels[0, 5:] = -100  # padding
    labels[2, :] = -100  # a sequence with no counted token
    out = model(input_ids=ids, labels=labels)
    total, tokens = token_cross_entropy(out.logits, labels, shift=True)
    assert int(tokens) == 4 + 7  # row 0: labels 1-4 count; row 1: 7; row 2: none
    assert torch.allclose(total / tokens, out.loss, atol=1e-6)


def test_tokens_after_plain_steps_are_refused_and_plain_jobs_pay_one_count() -> None:
    with Parallel(strategy="single") as par:
        model = par.prepare(_model())
        par.backward(model(torch.randn(2, 4)).sum())  # the first step decides: plain
        assert par._tokens._weighted is False
        with pytest.raises(UsageError, match="after steps without it"):
            par.backward(model(torch.randn(2, 4)).sum(), tokens=3)
