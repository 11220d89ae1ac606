"""Models bigger than one device: built empty, each rank's part allocated, then filled.

Three moments, so no rank ever holds the whole model:

1. **build** under :func:`empty_init` (``par.init_module()``): every parameter
   is created on the meta device (shape and dtype, no memory, no init work);
   buffers stay real, since non-persistent ones (rotary frequencies, masks)
   are computed in ``__init__`` and saved nowhere. A model built under
   ``torch.device("meta")`` works too when its buffers can be restored.
2. **place**: the strategy splits or shards the meta model first, then calls
   its :data:`Place` on each part it keeps; :func:`place` allocates that part
   (meta tensors become empty ones on the device; real ones are moved). A
   real-valued model is moved as before, part by part where the strategy
   splits it.
3. **fill**: values come from ``weights=`` (read straight into the shards by
   :mod:`manygpu.weights`) or, without it, from :func:`initialize`: each
   module's own ``reset_parameters()`` (or a Hugging Face model's
   ``_init_weights``) run on a full-size twin of that one module, seeded from
   the job's seed and the module's name, and each rank keeps its slice. So
   values do not depend on the strategy or the world size (a one-process run
   under ``init_module()`` gets the same ones), but they are not those of a
   model built without it, which draws from one shared random stream; only
   ``weights=`` gives exact equality with another run. A model with
   ``init_weights()`` of its own (torchtitan's convention) is trusted to
   initialise itself, sharded.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from manygpu.errors import UsageError
from manygpu.weights.shards import fill_one

Place = Callable[[nn.Module, torch.device], nn.Module]
"""What a strategy calls on each part of the model it keeps: that part, real, on the device."""


def move(module: nn.Module, device: torch.device) -> nn.Module:
    """The plain :data:`Place` for a model with real values: ``module.to(device)``."""
    return module.to(device)


@contextmanager
def empty_init() -> Iterator[None]:
    """Parameters registered inside go to the meta device; buffers stay real.

    The parameter is made where its module makes it, then replaced by a meta
    tensor of the same shape as it is registered (the way Accelerate's
    ``init_empty_weights`` works); a module's ``reset_parameters()`` at the
    end of its ``__init__`` then runs on meta tensors, at no cost.
    """
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and not param.is_meta:
            kwargs = dict(param.__dict__, requires_grad=param.requires_grad)
            self._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _tensors(module: nn.Module, recurse: bool = True) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from module.buffers(recurse=recurse)


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in _tensors(module))


def place(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` real on ``device``: meta tensors allocated (empty), real ones moved.

    Sharded parameters (DTensors) get only their local part: called after
    the strategy sharded, this allocates each rank's share and nothing more.
    """
    if has_meta(module):
        _allocate(module, device)
    return module.to(device)


@torch.no_grad()
def _allocate(module: nn.Module, device: torch.device) -> None:
    """Each meta parameter and buffer replaced by an empty one on ``device``.

    Not ``module.to_empty()``: that makes a new tensor per owner, so a tied
    weight (an embedding and its head) would come out as two parameters. Here
    a tensor shared by several modules stays one tensor.
    """
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                new = made.get(id(t))
                if new is None:
                    new = torch.empty_like(t, device=device)
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    made[id(t)] = new
                table[name] = new  # type: ignore[assignment]  # a Parameter where one was


def meta_buffers(model: nn.Module) -> list[str]:
    """Non-persistent buffers on the meta device: values no file holds."""
    out = []
    for qname, module in model.named_modules():
        lost = module._non_persistent_buffers_set
        out += [f"{qname}.{n}".lstrip(".") for n, b in module._buffers.items()
                if b is not None and b.is_meta and n in lost]  # fmt: skip
    return out


@dataclass(frozen=True)
class EmptyModules:
    """The modules of a model that were built empty, by name, taken before the strategy.

    Taken after the transforms (fp8 replaces ``nn.Linear`` modules) and
    before the strategy splits the model, so names are the whole model's.
    """

    root: nn.Module
    modules: tuple[tuple[str, nn.Module], ...]

    @classmethod
    def of(cls, model: nn.Module) -> EmptyModules:
        found = tuple(
            (qname, m) for qname, m in model.named_modules()
            if any(t.is_meta for t in _tensors(m, recurse=False))
        )  # fmt: skip
        return cls(model, found)

    def __bool__(self) -> bool:
        return bool(self.modules)


def _hf_init(root: nn.Module) -> Callable[[nn.Module], None] | None:
    """A Hugging Face model's per-module init (``_init_weights``), else ``None``."""
    init = getattr(root, "_init_weights", None)
    return init if callable(init) and hasattr(root, "config") else None


def check_initializable(empty: EmptyModules) -> None:
    """Refuse, before anything is allocated, a module no init can fill."""
    root = empty.root
    if _hf_init(root) is not None or callable(getattr(root, "init_weights", None)):
        return
    for qname, module in empty.modules:
        if not callable(getattr(module, "reset_parameters", None)):
            raise UsageError(
                f"module {qname or '(root)'} ({type(module).__name__}) was built empty under "
                "init_module() and has no reset_parameters() to initialise it: give "
                "prepare(..., weights=PATH), or add reset_parameters() (or an init_weights() "
                "on the model)"
            )


def initialize(empty: EmptyModules, seed: int) -> None:
    """Fill every module built empty whose tensors this rank now holds (see module doc)."""
    root = empty.root
    hf = _hf_init(root)
    whole = getattr(root, "init_weights", None)
    if hf is None and callable(whole):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            whole()
        return
    done: set[int] = set()  # a tied weight takes its first owner's init, as when built
    for qname, module in empty.modules:
        if any(t.is_meta for t in _tensors(module, recurse=False)):
            continue  # another rank's part (a pipeline stage it does not run)
        _init_one(qname, module, hf or _reset, seed, done)


def _reset(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def _module_seed(seed: int, qname: str) -> int:
    digest = hashlib.sha256(f"{seed}:{qname}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
def _init_one(
    qname: str, module: nn.Module, init: Callable[[nn.Module], None], seed: int, done: set[int]
) -> None:
    """``init`` on a full-size CPU twin of ``module``'s own parameters; keep our slice.

    The twin shares the module's buffers and children (an init that touches
    a child, as ``nn.MultiheadAttention``'s does, still works); only this
    module's parameters are whole, so one module is in flight at a time.
    """
    # A shallow copy made without calling the class: FSDP2's wrapper classes
    # re-run ``__init__`` in ``__new__``, which a copy must not do.
    twin = object.__new__(type(module))
    twin.__dict__.update(module.__dict__)
    twin._parameters = {
        name: None if p is None else nn.Parameter(
            torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad
        )
        for name, p in module._parameters.items()
    }  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_module_seed(seed, qname))
        init(twin)
    for name, p in module._parameters.items():
        full = twin._parameters[name]
        if p is not None and full is not None and id(p) not in done:
            # This rank's part, as a weights file's tensor would be read into it.
            fill_one(p, functools.partial(_block_of, full))
            done.add(id(p))


def _block_of(full: torch.Tensor, index: tuple[slice, ...] | None) -> torch.Tensor:
    return full if index is None else full[index]
