"""Horovod's PyTorch synthetic benchmark, run by manygpu.horovod: only the import line changed.

Written after Horovod's ``examples/pytorch/pytorch_synthetic_benchmark.py``:
one random batch, ``DistributedOptimizer``, the model and optimizer broadcast
from rank 0, a warm-up, then ``--num-iters`` timed runs of
``--num-batches-per-iter`` steps each, reported as images per second per
device and in total (mean +- 1.96 standard deviations).

The default model depends on the device: ResNet-50 on 224x224 images on a
GPU (Horovod's default), the small CIFAR-style ``resnet_cnn`` on 32x32 images
on a CPU, where one ResNet-50 step of 32 images takes about a minute per core.
``--model`` (and ``--image-size``) override the choice. The model comes from
torchvision when it is installed and has one of that name (as in Horovod's
example); otherwise ``resnet50`` and ``resnet_cnn`` come from manygpu's
benchmark networks, so the script runs on a bare install.

Run::

    manygpu launch --nproc-per-node 2 examples/horovod/synthetic_benchmark.py  # CPU: resnet_cnn
    manygpu launch examples/horovod/synthetic_benchmark.py       # every GPU, ResNet-50
    manygpu launch --nproc-per-node 2 examples/horovod/synthetic_benchmark.py --model resnet50
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.nn.functional as F
import torch.optim as optim

import manygpu.horovod as hvd  # was: import horovod.torch as hvd


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fp16-allreduce", action="store_true", default=False)
    p.add_argument("--model", type=str, default=None, help="default: by device (see above)")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--image-size", type=int, default=None, help="default: by model")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--no-cuda", action="store_true", default=False)
    p.add_argument("--use-adasum", action="store_true", default=False)
    p.add_argument("--json", default=None, help="rank 0 writes the results here")
    return p.parse_args()


GPU_MODEL, CPU_MODEL = "resnet50", "resnet_cnn"
"""Horovod's default network, and one a CPU core steps through in about a second."""


def pick_model(model: str | None, image_size: int | None, cuda: bool) -> tuple[str, int, str]:
    """The model, its image size and why: the one asked for, else one sized to the device.

    ResNet-50 is Horovod's default and what GPU throughputs are quoted for; on
    a CPU its warm-up alone takes minutes, so a CPU run gets the small ResNet
    on the 32x32 images it was built for, unless ``--model`` says otherwise.
    """
    if model is not None:
        why = "chosen by --model"
    elif cuda:
        model, why = GPU_MODEL, "the default on a GPU"
    else:
        model = CPU_MODEL
        why = f"the default on a CPU, where {GPU_MODEL} is too slow; --model {GPU_MODEL} to run it"
    if image_size is None:
        image_size = 32 if model == CPU_MODEL else 224
    return model, image_size, why


def build_model(name: str, classes: int) -> torch.nn.Module:
    """torchvision's model of that name, else manygpu's ResNet-50 / small ResNet."""
    try:
        from torchvision import models
    except ImportError:
        models = None
    if models is not None and hasattr(models, name):
        return getattr(models, name)(num_classes=classes)  # type: ignore[no-any-return]
    from manygpu.bench import nets

    local: dict[str, Callable[..., torch.nn.Module]] = {
        "resnet50": nets.resnet50,
        "resnet_cnn": nets.resnet_cnn,
    }
    if name not in local:
        raise SystemExit(f"--model {name}: install torchvision, or use {sorted(local)}")
    return local[name](classes=classes)


def main() -> None:
    args = parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
    cudnn.benchmark = True
    args.model, args.image_size, why = pick_model(args.model, args.image_size, args.cuda)

    model = build_model(args.model, args.num_classes)
    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size() if not args.use_adasum else 1
    if args.cuda:
        model.cuda()
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()
    optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
    )
    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Set up fixed fake data.
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.LongTensor(args.batch_size).random_() % args.num_classes
    if args.cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step() -> None:
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()

    def log(s: str) -> None:
        if hvd.rank() == 0:
            print(s, flush=True)

    device = "GPU" if args.cuda else "CPU"
    log(f"Model: {args.model} at {args.image_size}x{args.image_size} ({why})")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {device}s: {hvd.size()}")

    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)

    # Results
    img_sec_mean = float(np.mean(img_secs))
    img_sec_conf = float(1.96 * np.std(img_secs))
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(
        f"Total img/sec on {hvd.size()} {device}(s): "
        f"{hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}"
    )
    if args.json and hvd.rank() == 0:
        result = {
            "model": args.model,
            "image_size": args.image_size,
            "size": hvd.size(),
            "device": device,
            "img_sec_per_device": img_sec_mean,
            "img_sec_total": hvd.size() * img_sec_mean,
            "iters": img_secs,
        }
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
