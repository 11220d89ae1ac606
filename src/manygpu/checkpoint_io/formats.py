"""How model and optimizer state reach disk: one full copy, or DCP shards.

- ``full``: the main rank writes the whole (unwrapped) model and optimizer
  state with ``torch.save``; right for replicated strategies (single, dp, ddp),
  where every rank holds the same state. Loads on any number of ranks.
- ``dcp``: ``torch.distributed.checkpoint``: every rank writes its shards in
  parallel, and a load on another world size reshards. Needed for sharded
  strategies; works for replicated ones too.

Both write in the background when asked (``copy``): ``full`` from a snapshot in
:class:`~.staging.Staging`'s reused buffers, on the checkpointer's thread;
``dcp`` through torch's ``dcp.async_save`` and its stager (:func:`start_dcp`).

Both load without running code from the checkpoint: ``weights_only=True``
for our files, and :mod:`.safe_dcp` for DCP's metadata and non-tensor items.
Which format a directory holds is decided by its files (:func:`detect`), never
by a field of ``meta.json`` that anyone can edit.

Each format is an object (:data:`FULL`, :data:`DCP`) behind one small
interface, :class:`Format`, so a strategy names the one it needs and the
checkpointer never branches on a name. ``torch.distributed.checkpoint`` is
imported only when DCP is used: naming a format must stay cheap.

Every file is written through :class:`~.writer.DurableFile`: hashed while its
bytes stream out and fsynced, so the commit never reads a file back. A ``full``
resume maps the files (``mmap``) instead of reading them into fresh memory:
the verification has just brought them into the page cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from manygpu.checkpoint_io import remote, writer
from manygpu.checkpoint_io.remote import Url
from manygpu.checkpoint_io.staging import Staging
from manygpu.errors import CheckpointError, UsageError

MODEL, OPTIM, EXTRAS, SHARDS = "model.pt", "optim.pt", "extras.pt", "shards"

Where = Path | Url
"""Where a save writes: a local directory, or a step's location in a store (:mod:`.remote`)."""


def _whole_already(optimizer: torch.optim.Optimizer) -> None:
    """The default for :attr:`Parts.consolidate`: replicated state is whole everywhere."""


@dataclass(frozen=True, kw_only=True)
class Parts:
    """Everything a checkpoint saves and loads besides counters and RNGs.

    :meth:`manygpu.Parallel.checkpoint_parts` builds it, so the checkpointer
    never reaches into the strategy, the precision plugin or the config: what
    to save is the job's answer, how to write it is the :class:`Format`'s.
    """

    format: Format
    """How the state reaches disk (the strategy's choice unless the user names one)."""
    model: nn.Module
    """The user's (unwrapped) module."""
    wrapped: nn.Module
    """The module as the strategy wrapped it (DCP reads sharding from it)."""
    optimizer: torch.optim.Optimizer | None = None
    """The optimizer that holds the state (inside manygpu's accumulation wrapper)."""
    scheduler: Any = None
    """An LR scheduler (anything with ``state_dict``/``load_state_dict``); the user's."""
    scaler: torch.amp.GradScaler | None = None
    """fp16's loss scaler, whose scale must survive a resume."""
    consolidate: Callable[[torch.optim.Optimizer], None] = _whole_already
    """Makes ``optimizer.state_dict()`` whole on the main rank (collective; ZeRO needs it)."""
    seed: int | None = None
    """The job's seed: RNG streams for a new world size are derived from it on resume."""
    strategy: str = ""
    """The strategy's registered name, recorded in ``meta.json``."""
    precision: str = "fp32"
    """The job's precision, recorded in ``meta.json``."""

    def extras(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def load_extras(self, extras: dict[str, Any]) -> None:
        if self.scheduler is not None and "scheduler" in extras:
            self.scheduler.load_state_dict(extras["scheduler"])
        if self.scaler is not None and "scaler" in extras:
            self.scaler.load_state_dict(extras["scaler"])


def to_cpu_copy(tree: Any) -> Any:
    """A snapshot of a (small) state dict in fresh CPU memory."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: to_cpu_copy(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_cpu_copy(v) for v in tree)
    return tree


def _on_cpu(tree: Any) -> bool:
    if isinstance(tree, torch.Tensor):
        return tree.device.type == "cpu"
    if isinstance(tree, dict):
        return all(_on_cpu(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return all(_on_cpu(v) for v in tree)
    return True


def full_snapshot(parts: Parts, *, stage: Staging, copy: bool) -> dict[str, Any]:
    """Main rank's files for the ``full`` format.

    ``copy=True`` copies the tensors into ``stage``'s reusable CPU buffers
    (needed when training goes on while the files are written). Otherwise CPU
    tensors are written as they are, and tensors on a device are still staged:
    one batch of asynchronous copies into pinned buffers instead of one
    blocking copy per tensor inside ``torch.save``.
    """
    files = {MODEL: parts.model.state_dict(), EXTRAS: parts.extras()}
    if parts.optimizer is not None:
        files[OPTIM] = parts.optimizer.state_dict()
    return stage.stage(files) if copy or not _on_cpu(files) else files


def detect(directory: Path) -> str:
    """``"full"`` or ``"dcp"``, from the files the directory holds (exactly one kind)."""
    full = (directory / MODEL).is_file()
    dcp_meta = (directory / SHARDS / ".metadata").is_file()
    if full and not (directory / SHARDS).exists():
        return "full"
    if dcp_meta and not full:
        return "dcp"
    what = "both model.pt and shards/" if full else "neither model.pt nor shards/.metadata"
    raise CheckpointError(f"checkpoint {directory} holds {what}; it is not a checkpoint we wrote")


def save_one(state: Any, target: Where, pool: Any = None) -> dict[str, Any]:
    """``torch.save`` of one state to a file or an object, hashed while written; its entry."""
    if isinstance(target, Url):
        return remote.save(state, target, pool)
    return writer.save(state, target, pool)


def write_files(directory: Where, files: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Write each state with ``torch.save``, hashed as it streams; their file-table entries.

    The files are written at the same time, one thread each (``os.write``
    releases the GIL): one ``torch.save`` copies into the page cache on one
    core, and the disk gets more than one stream to flush. On tmpfs here that
    took the save from 0.82x to 0.71x of ``torch.save`` (median of 5).
    """
    from concurrent.futures import ThreadPoolExecutor

    from manygpu.checkpoint_io.integrity import hashing_pool

    if len(files) < 2:
        return {name: save_one(state, directory / name) for name, state in files.items()}
    with hashing_pool() as pool, ThreadPoolExecutor(len(files)) as files_pool:
        jobs = {
            name: files_pool.submit(save_one, state, directory / name, pool)
            for name, state in files.items()
        }
        return {name: job.result() for name, job in jobs.items()}


def load_file(path: Path, *, mmap: bool = False) -> Any:
    """``torch.load`` of one of our files, weights only; any failure is one line naming it."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError:
            if not mmap:
                raise
            # A filesystem that cannot map files: read it like torch.load does.
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except Exception as exc:  # unpickling errors come in many types
        raise CheckpointError(f"checkpoint file {path} cannot be read: {_why(exc)}") from None


def _why(exc: Exception) -> str:
    """The line of a load error that says what is wrong (a refused global, say)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
    if lines[0].startswith("Weights only load failed"):  # then advice; the reason follows
        lines = [ln for ln in lines if "GLOBAL" in ln or "nsupported" in ln] or lines
    return lines[0][:240]


def _fit(directory: Path, load: Any) -> None:
    """Run ``load``; a state that does not fit the model is one line naming the first misfit."""
    try:
        load()
    except RuntimeError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        misfit = next((ln for ln in lines[1:] if ln), lines[0] if lines else "")
        raise CheckpointError(
            f"checkpoint {directory} does not fit this model ({misfit[:240]}); "
            "build the model the way it was when the checkpoint was saved"
        ) from None


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _tensors(v)


def _load_optimizer(optimizer: torch.optim.Optimizer, loaded: Any) -> None:
    """``optimizer.load_state_dict(loaded)``, every state tensor in memory of its own.

    ``loaded`` is mapped from the file, and ``load_state_dict`` keeps a CPU
    tensor of the right dtype as it is: left mapped, the state would pin the
    checkpoint file's disk space after the checkpoint is pruned. A state tensor
    the optimizer already held (same shape, dtype and device: a resume into a
    running job) receives the values in place, so no new memory is allocated
    and faulted in (0.9 s of a 1.85 s resume here, for 800 MB of Adam state);
    otherwise the tensor is cloned. Device state was copied by the load.
    """
    held = {
        (id(param), key): value
        for param, state in optimizer.state.items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }
    optimizer.load_state_dict(loaded)
    mapped = {t.data_ptr() for t in _tensors(loaded) if t.numel()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if not (isinstance(value, torch.Tensor) and value.numel()):
                continue
            if value.data_ptr() not in mapped:
                continue
            old = held.get((id(param), key))
            if old is not None and _layout(old) == _layout(value):
                state[key] = old.copy_(value)
            else:
                state[key] = value.clone()


def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    return tensor.shape, tensor.dtype, tensor.device


def _read_model(directory: Path, parts: Parts) -> None:
    state = load_file(directory / MODEL, mmap=True)
    _fit(directory, lambda: parts.model.load_state_dict(state))


def read_full(directory: Path, parts: Parts) -> None:
    """Load a ``full`` checkpoint into ``parts`` (any world size)."""
    _read_model(directory, parts)  # its mapping is gone when it returns
    if parts.optimizer is not None:
        if not (directory / OPTIM).is_file():
            raise CheckpointError(f"checkpoint {directory} holds no optimizer state")
        _load_optimizer(parts.optimizer, load_file(directory / OPTIM, mmap=True))
    parts.load_extras(load_file(directory / EXTRAS))


def _dcp_state(parts: Parts) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optimizers = [parts.optimizer] if parts.optimizer is not None else []
    model_sd, optim_sd = get_state_dict(parts.wrapped, optimizers)
    state: dict[str, Any] = {"model": model_sd}
    if optimizers:
        state["optim"] = optim_sd
    return state


def _hashing_writer(shards: Where, entries: dict[Any, dict[str, Any]], pool: Any) -> Any:
    """DCP's ``FileSystemWriter`` writing through :class:`~.writer.DurableFile` (hashed as written).

    Each file's table entry lands in ``entries`` when the file is closed.
    """
    if isinstance(shards, Url):
        return _store_writer(shards, entries, pool)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            fh = writer.DurableFile(Path(path), pool)
            try:
                yield fh
            finally:
                fh.close()
            entries[Path(path)] = fh.entry()

        def rename(self, path: Any, new_path: Any) -> None:
            super().rename(path, new_path)
            if Path(path) in entries:  # DCP writes .metadata.tmp, then renames it
                entries[Path(new_path)] = entries.pop(Path(path))

    storage = dcp.FileSystemWriter(str(shards))
    storage.fs = HashingFileSystem()
    return storage


def _store_writer(shards: Url, entries: dict[Any, dict[str, Any]], pool: Any) -> Any:
    """DCP's writer into a store: each object through :class:`~.remote.ObjectFile` (hashed).

    torch's ``FsspecWriter`` commits by renaming ``.metadata.tmp``; here that
    rename is only a name change inside a step that is not yet committed:
    the commit is our ``meta.json``, written last (:mod:`.remote_layout`).
    ``sync_files`` is off: an object has no descriptor, and torch's fallback
    (``os.sync()`` of the whole machine) would only slow the save down.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    class HashingStore(FileSystem):
        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            fh = remote.ObjectFile(Url(shards.fs, str(path)), pool)
            try:
                yield fh
            except BaseException:
                fh.discard()
                raise
            fh.close()
            entries[str(path)] = fh.entry()

        def rename(self, path: Any, new_path: Any) -> None:
            super().rename(path, new_path)
            if str(path) in entries:  # DCP writes .metadata.tmp, then renames it
                entries[str(new_path)] = entries.pop(str(path))

    storage = dcp.FileSystemWriter(shards.path, sync_files=False)
    store = HashingStore()
    store.fs = shards.fs
    storage.fs = store  # type: ignore[assignment]
    storage.path = shards.path
    return storage


def _no_dist(group: Any) -> bool:
    """Whether DCP runs without collectives: no checkpoint group means a world of one."""
    return group is None and (not dist.is_initialized() or dist.get_world_size() == 1)


def _table(directory: Where, entries: dict[Any, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    if isinstance(directory, Url):
        return {directory.relative(str(name)): entry for name, entry in entries.items()}
    return {str(path.relative_to(directory)): entry for path, entry in entries.items()}


def write_dcp(directory: Where, parts: Parts, group: Any = None) -> dict[str, dict[str, Any]]:
    """Every rank writes its shards into ``directory/shards`` (collective over ``group``).

    Returns the file-table entries of the files this rank wrote.
    """
    import torch.distributed.checkpoint as dcp

    from manygpu.checkpoint_io.integrity import hashing_pool

    entries: dict[Any, dict[str, Any]] = {}
    with hashing_pool() as pool:
        dcp.save(
            _dcp_state(parts),
            storage_writer=_hashing_writer(directory / SHARDS, entries, pool),
            process_group=group,
            no_dist=_no_dist(group),
        )
    return _table(directory, entries)


def start_dcp(
    directory: Where, parts: Parts, *, group: Any, stage: Staging
) -> Callable[[], dict[str, dict[str, Any]]]:
    """Start writing this rank's shards in the background (``dcp.async_save``).

    Returns once the state is copied into ``stage``'s reused CPU buffers (torch's
    stager: pinned, non-blocking copies with CUDA); the training loop may then
    change the parameters. ``group`` must be used by nothing else while the
    write runs (DCP's collectives happen on its thread). Call the returned
    function to wait for the write; it returns this rank's file-table entries.
    """
    from contextlib import ExitStack

    import torch.distributed.checkpoint as dcp

    from manygpu.checkpoint_io.integrity import hashing_pool

    entries: dict[Any, dict[str, Any]] = {}
    with ExitStack() as stack:  # the hashing pool lives until the write is done
        pool = stack.enter_context(hashing_pool())
        started = dcp.async_save(
            _dcp_state(parts),
            storage_writer=_hashing_writer(directory / SHARDS, entries, pool),
            process_group=group,
            async_stager=stage.dcp_stager(),
            no_dist=_no_dist(group),
        )
        # A future, or (a stager that copies in the background) a response holding one.
        upload: Any = getattr(started, "upload_completion", started)
        close = stack.pop_all()

    def finish() -> dict[str, dict[str, Any]]:
        with close:
            upload.result()
        return _table(directory, entries)

    return finish


def read_dcp(directory: Path, parts: Parts, group: Any = None) -> None:
    """Load DCP shards into ``parts``, resharding to this world size (collective)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from manygpu.checkpoint_io.safe_dcp import safe_load

    state = _dcp_state(parts)
    safe_load(
        state,
        directory,
        process_group=group,
        no_dist=not dist.is_initialized(),
    )
    optimizers = [parts.optimizer] if parts.optimizer is not None else []
    set_state_dict(
        parts.wrapped,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
    parts.load_extras(load_file(directory / EXTRAS))


@dataclass
class Written:
    """What one rank's part of a save produced (:meth:`Format.write`)."""

    files: dict[str, Any] = field(default_factory=dict)
    """Files the main rank still has to write (name -> state), maybe in the background."""
    table: dict[str, dict[str, Any]] = field(default_factory=dict)
    """File-table entries (size, checksum) of the files this rank already wrote."""
    pending: Callable[[], dict[str, dict[str, Any]]] | None = None
    """This rank's write still running in the background; returns its file-table entries."""


class Format(ABC):
    """How model and optimizer state reach disk (one instance per format)."""

    name: ClassVar[str]
    """``"full"`` or ``"dcp"``: what :func:`detect` returns and ``meta.json`` records."""
    writes_in_background: ClassVar[bool] = False
    """Whether the files can be written in a thread after a CPU snapshot."""

    def check_background(self) -> None:
        """Raise :class:`UsageError` if this torch cannot write the format in the background."""

    @abstractmethod
    def write(
        self,
        directory: Where,
        parts: Parts,
        *,
        group: Any,
        main: bool,
        stage: Staging,
        copy: bool,
    ) -> Written:
        """This rank's part of a save (every rank calls it: it may be collective).

        Returns the files the main rank still has to write (name -> state), so
        that writing can happen in the background, and with ``copy`` this
        rank's own background write (:attr:`Written.pending`): either way the
        state was copied into ``stage``'s reusable CPU buffers, safe from the
        training that goes on. ``group`` is then used by the background write
        alone.
        """

    @abstractmethod
    def read(self, directory: Path, parts: Parts, *, group: Any) -> None:
        """Load ``directory`` into ``parts`` (every rank calls it)."""

    def __repr__(self) -> str:
        return f"<checkpoint format {self.name!r}>"


class FullFormat(Format):
    """One whole copy, written by the main rank; for replicated strategies."""

    name = "full"
    writes_in_background = True

    def write(
        self,
        directory: Where,
        parts: Parts,
        *,
        group: Any,
        main: bool,
        stage: Staging,
        copy: bool,
    ) -> Written:
        if parts.optimizer is not None:
            parts.consolidate(parts.optimizer)  # collective: before the main rank reads it
        return Written(files=full_snapshot(parts, stage=stage, copy=copy) if main else {})

    def read(self, directory: Path, parts: Parts, *, group: Any) -> None:
        read_full(directory, parts)


class DcpFormat(Format):
    """Shards written by every rank in parallel; needed for sharded strategies.

    With ``copy`` the shards are written by ``torch.distributed.checkpoint``'s
    ``async_save`` after its stager copied them into reused CPU buffers.
    """

    name = "dcp"
    writes_in_background = True

    def check_background(self) -> None:
        from torch.distributed.checkpoint import staging

        if not hasattr(staging, "DefaultStager"):
            raise UsageError(
                f"Checkpointer(format='dcp', async_save=True) needs torch's DCP DefaultStager, "
                f"which torch {torch.__version__} lacks; upgrade torch or use format='full'"
            )

    def write(
        self,
        directory: Where,
        parts: Parts,
        *,
        group: Any,
        main: bool,
        stage: Staging,
        copy: bool,
    ) -> Written:
        extras = {EXTRAS: to_cpu_copy(parts.extras())} if main else {}
        if copy:
            pending = start_dcp(directory, parts, group=group, stage=stage)
            return Written(files=extras, pending=pending)
        return Written(files=extras, table=write_dcp(directory, parts, group=group))

    def read(self, directory: Path, parts: Parts, *, group: Any) -> None:
        read_dcp(directory, parts, group=group)


FULL: Format = FullFormat()
DCP: Format = DcpFormat()
_BY_NAME = {fmt.name: fmt for fmt in (FULL, DCP)}


def as_format(value: Format | str) -> Format:
    """The format object for ``value`` (a name such as a user's ``format="dcp"``, or a format)."""
    if isinstance(value, Format):
        return value
    found = _BY_NAME.get(value)
    if found is None:
        choices = " or ".join(_BY_NAME)
        raise UsageError(f"unknown checkpoint format {value!r}; choose {choices}")
    return found
