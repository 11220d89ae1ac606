"""The Horovod synthetic benchmark sizes its default model to the device.

ResNet-50 is Horovod's default and right on a GPU, but on a CPU one step of
32 images takes about a minute per core; there the example must pick the small
``resnet_cnn`` (on its 32x32 images) unless ``--model`` says otherwise. The
script is loaded from its path, as an example is not a package module.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "horovod" / "synthetic_benchmark.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hvd_synthetic_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_default_is_the_small_model_on_small_images(bench: ModuleType) -> None:
    model, size, why = bench.pick_model(None, None, cuda=False)
    assert (model, size) == ("resnet_cnn", 32)
    assert "CPU" in why and "--model resnet50" in why


def test_gpu_default_stays_resnet50_at_224(bench: ModuleType) -> None:
    model, size, why = bench.pick_model(None, None, cuda=True)
    assert (model, size) == ("resnet50", 224)
    assert "GPU" in why


def test_model_flag_overrides_the_device_choice(bench: ModuleType) -> None:
    assert bench.pick_model("resnet50", None, cuda=False)[:2] == ("resnet50", 224)
    assert bench.pick_model("resnet_cnn", None, cuda=True)[:2] == ("resnet_cnn", 32)
    assert "--model" in bench.pick_model("resnet50", None, cuda=False)[2]


def test_image_size_flag_is_kept(bench: ModuleType) -> None:
    assert bench.pick_model(None, 64, cuda=False)[:2] == ("resnet_cnn", 64)


def test_small_model_builds_without_torchvision_names(bench: ModuleType) -> None:
    """resnet_cnn is manygpu's own: it must build whether or not torchvision is installed."""
    net = bench.build_model("resnet_cnn", 10)
    assert sum(p.numel() for p in net.parameters()) > 0
