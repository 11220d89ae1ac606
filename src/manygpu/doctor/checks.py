"""Checks of one machine: pure functions of its :class:`Facts`.

Each returns :class:`CheckResult` values: ``ok``, ``warn`` (works, but slower
or fragile) or ``fail`` (a multi-GPU job will break), with one line saying how
to fix it. A check that does not apply here (P2P on a one-GPU box) returns
nothing. Host checks (shared memory, limits, network) are in
:mod:`manygpu.doctor.hostchecks`; checks across ranks and of the live test in
:mod:`manygpu.doctor.crosscheck`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from manygpu.doctor.facts import Facts, GPUFacts
from manygpu.doctor.hostchecks import (
    check_env,
    check_ifnames,
    check_limits,
    check_network,
    check_rdma,
    check_shm,
)
from manygpu.doctor.result import CheckResult, fail, human_bytes, ok, warn

HOT_C = 85

# Oldest driver branch whose CUDA is the given one (NVIDIA's release notes).
DRIVER_FOR_CUDA = {
    "11.8": "520",
    "12.0": "525",
    "12.1": "530",
    "12.2": "535",
    "12.3": "545",
    "12.4": "550",
    "12.5": "555",
    "12.6": "560",
    "12.8": "570",
    "12.9": "575",
    "13.0": "580",
}


def first_sentence(text: str | None) -> str:
    """torch's CUDA warnings run on for lines; the first sentence says what is wrong."""
    if not text:
        return "CUDA is not available"
    return text.partition(". ")[0]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def check_gpus(f: Facts) -> list[CheckResult]:
    t, n = f.torch, len(f.gpus)
    if n == 0 and not t.cuda_available:
        why = f" ({f.driver.error})" if f.driver.error else ""
        return [
            warn(
                "gpus",
                f"no GPU on this machine{why}: jobs run as CPU processes on gloo",
                "fine for testing the CPU / gloo path; GPU training needs a GPU and its driver",
            )
        ]
    if t.build == "cpu":
        return [
            fail(
                "gpus",
                f"PyTorch {t.version} is a CPU build but this machine has {n} GPU(s)",
                f"install a CUDA build of torch (one for CUDA <= {f.driver.cuda or 'the driver'})",
            )
        ]
    visible = f.env.get("CUDA_VISIBLE_DEVICES")
    if not t.cuda_available or t.device_count == 0:
        if visible is not None and not [v for v in visible.split(",") if v.strip()]:
            return [
                fail(
                    "gpus",
                    f"CUDA_VISIBLE_DEVICES={visible!r} hides all {n} GPUs",
                    "unset CUDA_VISIBLE_DEVICES, or list GPUs (manygpu launch --gpus 0,1)",
                )
            ]
        return [
            fail(
                "gpus",
                f"torch cannot use the {n} GPU(s): {first_sentence(t.cuda_error)}",
                "match the driver and torch's CUDA (see the driver check), then re-run",
            )
        ]
    names = Counter(g.name for g in f.gpus)
    what = ", ".join(f"{c} x {name}" for name, c in names.items()) or f"{t.device_count} GPU(s)"
    return [ok("gpus", f"{what}; torch sees {t.device_count} ({t.build} {t.cuda or t.hip})")]


def check_driver(f: Facts) -> list[CheckResult]:
    built, have = f.torch.cuda, f.driver.cuda
    if f.torch.build != "cuda" or not built or not have:
        return []
    need = DRIVER_FOR_CUDA.get(built, "")
    newer = f"R{need} or newer" if need else f"one for CUDA {built} or newer"
    msg = f"driver {f.driver.version} supports CUDA {have} but PyTorch was built for {built}"
    if _version(have)[:1] < _version(built)[:1]:
        return [
            fail(
                "driver",
                msg + ": CUDA cannot start",
                f"update the NVIDIA driver ({newer}), or install torch built for CUDA <= {have}",
            )
        ]
    if _version(have) < _version(built):
        return [
            warn(
                "driver",
                msg + " (runs only through minor-version compatibility; PTX JIT fails)",
                f"update the NVIDIA driver ({newer}), or install torch built for CUDA <= {have}",
            )
        ]
    return [ok("driver", f"driver {f.driver.version} (CUDA {have}) runs PyTorch's CUDA {built}")]


def supports_arch(cc: str, arch_list: Sequence[str]) -> bool:
    """Whether kernels for compute capability ``cc`` are in ``arch_list``: the
    same major with an equal or lower minor (binary compatible), or PTX
    (``compute_XY``) of an equal or lower version that the driver can JIT."""
    major, _, minor = cc.partition(".")
    want = (int(major), int(minor or 0))
    for arch in arch_list:
        kind, _, num = arch.partition("_")
        digits = "".join(ch for ch in num if ch.isdigit())
        if len(digits) < 2:
            continue
        have = (int(digits[:-1]), int(digits[-1]))
        if kind == "sm" and have[0] == want[0] and have[1] <= want[1]:
            return True
        if kind == "compute" and have <= want:
            return True
    return False


def check_arch(f: Facts) -> list[CheckResult]:
    arch = f.torch.arch_list
    if f.torch.build != "cuda" or not arch or not f.gpus:
        return []
    out = []
    for g in f.gpus:
        if g.compute_capability and not supports_arch(g.compute_capability, arch):
            sm = "sm_" + g.compute_capability.replace(".", "")
            out.append(
                fail(
                    "arch",
                    f"GPU {g.index} ({g.name}, {sm}) is not among this PyTorch's "
                    f"architectures ({' '.join(arch)})",
                    f"install a torch build compiled for {sm} (another CUDA variant of the wheel)",
                )
            )
    return out or [ok("arch", f"PyTorch has kernels for every GPU ({' '.join(arch)})")]


def check_libraries(f: Facts) -> list[CheckResult]:
    t = f.torch
    out = []
    if not t.gloo_available:
        out.append(
            fail("gloo", "torch.distributed has no gloo backend", "install an official torch wheel")
        )
    if t.build == "cpu" or not t.cuda_available:
        return out or [ok("libraries", "gloo available (the CPU backend)")]
    if t.cudnn is None and t.build == "cuda":
        out.append(
            warn(
                "cudnn",
                "PyTorch finds no cuDNN: convolutions fall back to slow kernels",
                "install a torch wheel (it bundles cuDNN) or put cuDNN on LD_LIBRARY_PATH",
            )
        )
    if not t.nccl_available or t.nccl is None:
        status = fail if len(f.gpus) > 1 else warn
        out.append(
            status(
                "nccl",
                "torch.distributed has no NCCL: GPUs cannot use the nccl backend",
                "install a CUDA torch wheel from the official index (they bundle NCCL)",
            )
        )
    if out:
        return out
    return [ok("libraries", f"cuDNN {t.cudnn}, NCCL {t.nccl}, gloo")]


def check_gpu_models(f: Facts) -> list[CheckResult]:
    names = Counter(g.name for g in f.gpus)
    if len(names) < 2:
        return []
    listing = ", ".join(f"{c} x {n}" for n, c in names.items())
    return [
        warn(
            "gpu_models",
            f"mixed GPU models ({listing}): the slowest sets the pace of every step",
            "use --gpus to run on one model only",
        )
    ]


def _gpu_health(g: GPUFacts) -> list[CheckResult]:
    out = []
    if g.ecc_uncorrected_errors:
        out.append(
            fail(
                "gpu_health",
                f"GPU {g.index} has {g.ecc_uncorrected_errors} uncorrected ECC errors since boot",
                "drain the node and reset the GPU (nvidia-smi -r), or have it replaced",
            )
        )
    if g.temperature_c is not None and g.temperature_c >= HOT_C:
        out.append(
            warn(
                "gpu_health",
                f"GPU {g.index} is at {g.temperature_c} C: it will throttle",
                "check the cooling (fans, airflow, data-centre inlet temperature)",
            )
        )
    if g.processes:
        who = ", ".join(
            f"pid {p.pid} {p.name}".strip()
            + (f" ({human_bytes(p.used_memory_bytes)})" if p.used_memory_bytes else "")
            for p in g.processes
        )
        out.append(
            warn(
                "gpu_busy",
                f"GPU {g.index} is in use by {who}",
                "stop those processes, or leave this GPU out (manygpu launch --gpus ...)",
            )
        )
    return out


def check_gpu_health(f: Facts) -> list[CheckResult]:
    if not f.gpus:
        return []
    out = [r for g in f.gpus for r in _gpu_health(g)]
    return out or [ok("gpu_health", f"{len(f.gpus)} GPU(s): no ECC errors, not hot, not in use")]


def check_p2p(f: Facts) -> list[CheckResult]:
    if len(f.gpus) < 2 and len(f.links) == 0:
        return []
    paths = Counter(link.path for link in f.links)
    summary = ", ".join(f"{p} x{c}" for p, c in paths.most_common())
    broken = [link for link in f.links if link.p2p is False]
    if not broken:
        unknown = sum(link.p2p is None for link in f.links)
        extra = f"; {unknown} pair(s) unknown" if unknown else ""
        return [ok("p2p", f"every GPU pair has P2P access (paths: {summary}){extra}")]
    pairs = ", ".join(f"{link.a} and {link.b}" for link in broken)
    details = {link.p2p_detail for link in broken if link.p2p_detail}
    why = f" ({', '.join(sorted(details))})" if details else ""
    return [
        warn(
            "p2p",
            f"GPU {pairs} have no P2P access{why}: traffic goes through the host",
            "enable P2P across the PCIe root (disable ACS, iommu=pt), or keep a job on "
            "GPUs that share a switch (manygpu launch --gpus ...)",
        )
    ]


def check_probes(f: Facts) -> list[CheckResult]:
    return [
        warn("probe", f"could not probe {what}: {why}", "this fact is unknown; see the reason")
        for what, why in f.errors.items()
    ]


CHECKS: tuple[Callable[[Facts], list[CheckResult]], ...] = (
    check_gpus,
    check_driver,
    check_arch,
    check_libraries,
    check_gpu_models,
    check_gpu_health,
    check_p2p,
    check_shm,
    check_limits,
    check_ifnames,
    check_network,
    check_rdma,
    check_env,
    check_probes,
)


def run_checks(f: Facts, host: str = "") -> list[CheckResult]:
    """Every check of one machine, in the order a person would fix them."""
    results = [r for check in CHECKS for r in check(f)]
    for r in results:
        r.host = host
    return results


__all__ = ["CHECKS", "CheckResult", "run_checks"]
