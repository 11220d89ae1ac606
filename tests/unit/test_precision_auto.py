"""precision="auto" (the default) resolves per device; TF32 unless "fp32-strict"; said once.

Resolution is a pure function of (request, device type, compute capability), so
fake GPUs (an H100's 9.0, an A100's 8.0, a V100's 7.0, a T4's 7.5) are tested here
on the CPU. The CPU path must not change: fp32, no scaler, no message, TF32 switches
untouched.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from reference import make_data, make_model

import manygpu
from manygpu import Parallel, ParallelConfig, UsageError
from manygpu.core.config import PRECISIONS
from manygpu.core.precision import (
    PrecisionChoice,
    announcement,
    apply_tf32,
    resolve_precision,
)
from manygpu.strategies import get_strategy

H100, A100, T4, V100 = (9, 0), (8, 0), (7, 5), (7, 0)


@pytest.mark.parametrize(
    "device_type, capability, precision, tf32",
    [
        ("cpu", None, "fp32", False),
        ("cuda", H100, "bf16", True),
        ("cuda", A100, "bf16", True),
        ("cuda", T4, "fp16", True),
        ("cuda", V100, "fp16", True),
        ("cuda", None, "fp32", True),  # capability unknown: nothing assumed
        ("mps", None, "fp32", False),  # a device we know nothing of: as the CPU
    ],
)
def test_auto_resolves_per_device(
    device_type: str, capability: tuple[int, int] | None, precision: str, tf32: bool
) -> None:
    choice = resolve_precision("auto", device_type=device_type, capability=capability)
    assert (choice.precision, choice.tf32) == (precision, tf32)
    assert choice.requested == "auto"


@pytest.mark.parametrize("requested", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("device_type, capability", [("cpu", None), ("cuda", V100), ("cuda", H100)])
def test_explicit_precisions_are_kept_everywhere(
    requested: str, device_type: str, capability: tuple[int, int] | None
) -> None:
    choice = resolve_precision(requested, device_type=device_type, capability=capability)
    assert choice.precision == requested
    assert choice.tf32 is (device_type == "cuda")


def test_fp32_strict_is_fp32_without_tf32() -> None:
    for device_type, cap in [("cpu", None), ("cuda", H100)]:
        choice = resolve_precision("fp32-strict", device_type=device_type, capability=cap)
        assert (choice.precision, choice.tf32) == ("fp32", False)


def test_auto_avoids_what_the_strategy_refuses() -> None:
    """The pipeline cannot scale fp16 losses: on a V100 "auto" falls back to fp32 there."""
    refused = get_strategy("pipeline").refused_precisions
    assert "fp16" in refused
    on_v100 = resolve_precision("auto", device_type="cuda", capability=V100, refused=refused)
    assert on_v100.precision == "fp32"
    on_h100 = resolve_precision("auto", device_type="cuda", capability=H100, refused=refused)
    assert on_h100.precision == "bf16"
    # An explicit request is not rewritten: the strategy refuses it by name.
    explicit = resolve_precision("fp16", device_type="cuda", capability=V100, refused=refused)
    assert explicit.precision == "fp16"


def test_announcement_names_the_choice_and_the_way_out() -> None:
    bf16 = resolve_precision("auto", device_type="cuda", capability=H100)
    assert announcement(bf16, "NVIDIA H100 80GB HBM3") == (
        "manygpu: precision='auto' chose bf16 autocast (fp32 weights), fp32 matmuls in TF32 "
        "on NVIDIA H100 80GB HBM3; precision='fp32' to turn it off ('fp32-strict' also "
        "turns off TF32)"
    )
    fp16 = announcement(resolve_precision("auto", device_type="cuda", capability=V100), "V100")
    assert fp16 is not None
    assert "chose fp16 autocast with loss scaling (fp32 weights" in fp16
    assert "TF32" in fp16 and "matmuls in TF32" not in fp16  # a V100 has no TF32 cores
    assert "precision='fp32' to turn it off" in fp16
    fp32 = announcement(resolve_precision("fp32", device_type="cuda", capability=A100), "A100")
    assert fp32 == (
        "manygpu: precision='fp32' runs fp32 matmuls and convolutions in TF32 on A100; "
        "precision='fp32-strict' to turn it off"
    )


@pytest.mark.parametrize(
    "requested, device_type, capability",
    [
        ("auto", "cpu", None),  # the CPU's fp32 is what the user had anyway
        ("fp32-strict", "cuda", H100),  # nothing was chosen for the user
        ("fp32", "cuda", V100),  # no TF32 on a V100: nothing changed
        ("bf16", "cuda", H100),  # asked for by name
    ],
)
def test_nothing_to_announce(requested: str, device_type: str, capability: tuple[int, int]) -> None:
    choice = resolve_precision(requested, device_type=device_type, capability=capability)
    assert announcement(choice, "gpu") is None


@pytest.fixture
def tf32_switches() -> Iterator[None]:
    """Leave torch's process-wide TF32 switches as the test found them."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.usefixtures("tf32_switches")
def test_tf32_switches_are_set_on_cuda_and_restored() -> None:
    """torch's switches exist (and are settable) in a CPU build: the CUDA path runs here."""
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, False
    restore = apply_tf32(resolve_precision("auto", device_type="cuda", capability=H100))
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    restore()
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    # Strict turns off even cuDNN's TF32, which torch enables by default.
    torch.backends.cudnn.allow_tf32 = True
    restore = apply_tf32(resolve_precision("fp32-strict", device_type="cuda", capability=H100))
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    restore()
    assert torch.backends.cudnn.allow_tf32


@pytest.mark.usefixtures("tf32_switches")
def test_cpu_default_is_fp32_and_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    assert ParallelConfig().precision == "auto"
    with Parallel(strategy="single", device="cpu") as par:
        assert par.precision_choice == PrecisionChoice(
            requested="auto", precision="fp32", device_type="cpu", tf32=False
        )
        assert par.precision.scaler is None and par.precision.dtype is None
        model = par.prepare(make_model())
        assert model(make_data(2)[0]).dtype == torch.float32
        assert par.job_state.parts(model).precision == "fp32"
        assert "precision='fp32'" in repr(par)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    assert capsys.readouterr().out == ""


def test_strategies_see_the_resolved_precision() -> None:
    with Parallel(strategy="single", device="cpu", precision="fp32-strict") as par:
        assert par.strategy.job.precision == "fp32"
        assert par.job_state.parts(par.prepare(make_model())).precision == "fp32"


def test_every_precision_is_accepted_and_others_named() -> None:
    assert PRECISIONS == ("auto", "fp32", "fp32-strict", "bf16", "fp16", "fp8")
    for name in PRECISIONS:
        assert ParallelConfig(precision=name).precision == name  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="choose one of auto, fp32, fp32-strict, bf16, fp16, fp8"):
        ParallelConfig(precision="tf32")  # type: ignore[arg-type]


def test_compile_options_are_exported_and_validated() -> None:
    assert manygpu.CompileOptions is manygpu.strategies.CompileOptions
    assert "CompileOptions" in manygpu.__all__
    assert ParallelConfig(compile=True).compile_options == manygpu.CompileOptions()
    assert ParallelConfig().compile_options is None
    opts = manygpu.CompileOptions(mode="max-autotune", fullgraph=True, dynamic=False)
    assert ParallelConfig(compile=opts).compile_options is opts
    with pytest.raises(UsageError, match="unknown compile mode 'fast'"):
        manygpu.CompileOptions(mode="fast")
    with pytest.raises(UsageError, match="compile takes True, False or a CompileOptions"):
        ParallelConfig(compile="yes")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="channels_last takes True, False or None"):
        ParallelConfig(channels_last=1)  # type: ignore[arg-type]


def test_outputs_to_fp32_keeps_structure_and_other_dtypes() -> None:
    """Tuples, dicts and named tuples keep their shape; only the autocast dtype moves."""
    from collections import namedtuple

    from manygpu.core.precision import outputs_to_fp32

    Pair = namedtuple("Pair", "logits ids")
    low = torch.ones(2, dtype=torch.bfloat16, requires_grad=True)
    out = outputs_to_fp32(
        {"a": (low, torch.arange(3)), "b": Pair(low * 2, torch.zeros(1, dtype=torch.float16))},
        torch.bfloat16,
    )
    assert out["a"][0].dtype == torch.float32 and out["a"][0].requires_grad
    assert out["a"][1].dtype == torch.int64
    assert isinstance(out["b"], Pair) and out["b"].logits.dtype == torch.float32
    assert out["b"].ids.dtype == torch.float16  # not the autocast dtype: left alone


def test_hf_model_output_comes_back_fp32_with_its_type() -> None:
    """A ``transformers`` model's ``ModelOutput`` under bf16: same class, fp32 logits,
    the loss HF computed inside autocast (fp32 there) unchanged."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    with Parallel(strategy="single", device="cpu", precision="bf16") as par:
        model = par.prepare(transformers.GPT2LMHeadModel(config))
        ids = torch.randint(0, 64, (2, 8))
        out = model(input_ids=ids, labels=ids)
        assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
        assert out.logits.dtype == torch.float32 and out.loss.dtype == torch.float32
        par.backward(out.loss)
