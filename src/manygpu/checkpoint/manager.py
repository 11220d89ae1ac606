"""One call to save, one to resume: :class:`Checkpointer`.

Saves model, optimizer, LR scheduler, grad scaler, step, the data loader's
position inside its epoch, and every rank's RNGs; resume is exact (the same
losses and final parameters as an uninterrupted run, bitwise on CPU fp32), with
one exception: torch's DDP rebuilds its gradient buckets after each process's
first backward (in the order gradients became ready), so under ddp the first
step after a resume may sum gradients in another order: last-bit differences
(2.4e-7 after 24 steps of a small GPT resumed twice; fsdp's resume is bitwise).
Saves every ``every`` steps, keeps the newest ``keep``, and on SIGTERM or
Slurm's warning SIGUSR1 (a preemption, see :mod:`.preemption`) saves at the next
step boundary and exits cleanly (requeueing the Slurm job on the warning).
What to save comes from :attr:`manygpu.Parallel.job_state`; how to write
it, from the parts' :class:`~.formats.Format`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from manygpu.checkpoint import corrupt
from manygpu.checkpoint.preemption import (
    PreemptionNotice,
    exit_now,
    requeue_slurm_job,
    wants_requeue,
)
from manygpu.checkpoint.resumed import Position, Resumed, position
from manygpu.checkpoint_io import formats, layout, rng, store
from manygpu.checkpoint_io.staging import Staging, pin_wanted
from manygpu.comm.objects import all_gather_json, broadcast_json, parse_each
from manygpu.errors import CheckpointError, UsageError
from manygpu.runtime import env as envmod
from manygpu.runtime import ray_train

if TYPE_CHECKING:
    from manygpu.core.data import PreparedLoader
    from manygpu.core.parallel import Parallel


@dataclass
class TrainState:
    """Counters the loop owns; saved with every checkpoint."""

    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """The epoch the loader is in (set on resume)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable values of your own (best loss, ...)."""


class Checkpointer:
    """Save and resume a training job.

    Args:
        par: the job's :class:`~manygpu.Parallel`.
        directory: where ``step-N`` directories go (shared by all ranks): a local
            path, or an fsspec URL (``s3://bucket/prefix``, ``gs://``, ``az://``,
            ``memory://``), where each rank writes its objects straight to the
            store and ``meta.json``, written last, is the commit
            (:mod:`~manygpu.checkpoint_io.store`).
        model: the prepared model; optimizer / scheduler / loader likewise.
        every: save every this many steps in :meth:`after_step` (0: never).
        keep: newest checkpoints kept; older ones are deleted after a save.
        async_save: write in the background after a CPU snapshot, so training
            stalls only for the copy. The snapshot goes into CPU buffers
            allocated at the first save and reused by every later one (pinned
            on CUDA machines); ``dcp`` saves go through torch's
            ``dcp.async_save`` and its stager.
        handle_signals: on SIGTERM or SIGUSR1 (Slurm's ``--signal=USR1@N``), save
            at the next :meth:`after_step` and exit 0.
        requeue: ``scontrol requeue`` the Slurm job after that save; ``None`` (the
            default): only when the notice was SIGUSR1 under Slurm (the time limit
            is near and the work is not done).
        format: ``"full"`` or ``"dcp"``; default: what the strategy needs.
        checkpoint_timeout_s: how long ranks wait for each other inside a save
            or resume (disk work of large models takes minutes).
        storage_options: for a URL, options for its fsspec filesystem (e.g.
            ``{"endpoint_url": ..., "profile": ...}``); otherwise the store
            library's own configuration (``AWS_*`` variables, config files,
            instance roles) applies. Never printed.

    Every rank must construct it (it creates a process group). With a URL every
    rank checks at once that it can write there: a missing backend, a missing
    bucket or refused credentials is one :class:`UsageError` line, before training.
    """

    def __init__(
        self,
        par: Parallel,
        directory: str | Path,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        loader: PreparedLoader | None = None,
        every: int = 0,
        keep: int = 3,
        async_save: bool = False,
        handle_signals: bool = True,
        requeue: bool | None = None,
        format: str | None = None,
        checkpoint_timeout_s: float = 1800.0,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        _check_counts(every, keep)
        self.par = par
        self.store = store.open_store(directory, storage_options)
        self.root = self.store.root
        parts = par.job_state.parts(model, optimizer)
        self.parts = replace(
            parts, scheduler=scheduler, format=formats.as_format(format or parts.format)
        )
        self.loader = loader
        self.every, self.keep = every, keep
        self.async_save = async_save and self.parts.format.writes_in_background
        if self.async_save:
            self.parts.format.check_background()
        self.requeue = requeue
        # Checkpoint coordination waits on the main rank's disk work (writing,
        # fsync, hashing), which can outlast the training timeout: a gloo group
        # of its own with a long timeout (also usable when training uses NCCL).
        self.timeout_s = checkpoint_timeout_s
        self._group = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=checkpoint_timeout_s))
            if par.world_size > 1
            else None
        )
        # Background writes coordinate (DCP's collectives, the file table) on a
        # group of their own: the training thread goes on using self._group.
        self._bg_group = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=checkpoint_timeout_s))
            if self.async_save and par.world_size > 1
            else None
        )
        self._agree(self.store.probe(par.rank), UsageError)
        self._pending: threading.Thread | None = None
        # CPU buffers for snapshots (async saves; blocking saves of device
        # tensors): allocated at the first save that needs them, then reused.
        self._staging = Staging(pin=pin_wanted(cuda_available=torch.cuda.is_available()))
        self._error: BaseException | None = None
        self._unreported: tuple[int, store.Location] | None = None
        self._preemption = PreemptionNotice()
        if handle_signals:
            self._preemption.listen()

    @property
    def format(self) -> str:
        """The name of the format this checkpointer writes (``"full"`` or ``"dcp"``)."""
        return self.parts.format.name

    # -- saving -----------------------------------------------------------------
    def save(self, state: TrainState) -> store.Location:
        """Write a checkpoint of ``state`` (collective: every rank calls it).

        With ``async_save`` it returns once the state is copied: the training
        loop may change the parameters at once, the checkpoint holds them as
        they were at this call. It is committed (files fsynced, ``meta.json``
        written, directory renamed) in the background; :meth:`wait` waits.
        """
        self._raise_everywhere()  # also: the staging buffers are free again
        tmp, final = self.store.slots(state.step)
        if self.par.is_main:
            self.store.prepare(tmp)
        self._barrier()
        meta = self._meta(state)
        written = formats.Written()
        try:
            if not self.store.visible(tmp):
                raise CheckpointError(
                    f"{tmp} is not visible on rank {self.par.rank}: the checkpoint directory "
                    "must be on a filesystem shared by every node"
                )
            name = f"rng-rank{self.par.rank}.pt"
            table = {name: formats.save_one(rng.capture(), tmp / name)}
            written = self.parts.format.write(
                tmp,
                self.parts,
                group=self._bg_group if self.async_save else self._group,
                main=self.par.is_main,
                stage=self._staging,
                copy=self.async_save,
            )
            written.table |= table
            failure = None
        except BaseException as exc:  # every rank must hear of it, or the others hang
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            failure = _failure(exc, self.par.rank, lambda e: self._why(e, tmp))
        try:
            # Also the barrier: every rank's files are in tmp, their entries here.
            table = self._gather_table(failure, written.table)
        except CheckpointError:
            pending = written.pending
            if pending is not None:  # its thread ends with DCP's error or timeout
                self._start(lambda: _quietly(pending))
            if self.par.is_main:  # a partial directory only takes space (a full disk)
                self.store.discard(tmp)
            raise
        if self.async_save:  # every rank: its own writes, then the commit on the main rank
            self._start(lambda: self._background(tmp, final, meta, written, table))
            self._unreported = (state.step, final)  # to Ray Train once known committed
        else:
            if self.par.is_main:
                self._finish(tmp, final, meta, written.files, table)
            self._raise_everywhere()  # nobody reads the directory before it is committed
            self._report(state.step, final)
        return final

    def _report(self, step: int, final: store.Location) -> None:
        """A committed step to Ray Train, when the job runs under it (every rank)."""
        ray_train.report_checkpoint(step, str(final) if self.par.is_main else None)

    def _report_committed(self) -> None:
        """The asynchronous save every rank now knows committed, to Ray Train."""
        if self._unreported is not None:
            step, final = self._unreported
            self._unreported = None
            self._report(step, final)

    def _start(self, job: Callable[[], None]) -> None:
        self._pending = threading.Thread(target=job, name="manygpu-checkpoint", daemon=False)
        self._pending.start()

    def _barrier(self) -> None:
        if self._group is not None:
            try:
                dist.monitored_barrier(group=self._group, timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                raise CheckpointError(
                    f"rank {self.par.rank}: checkpoint barrier failed: {str(exc).splitlines()[0]}"
                ) from exc

    def _broadcast_verdict(self, verdict: tuple[str, str]) -> tuple[str, str]:
        """The main rank's ``(kind, value)`` on every rank (as JSON, over the checkpoint group)."""
        if self._group is None:
            return verdict
        sent = broadcast_json(
            list(verdict), 0, operation=_VERDICT, timeout_s=self.timeout_s, group=self._group
        )
        return parse_each([sent], _verdict, operation=_VERDICT)[0]  # only the main rank sends

    def _gather_table(
        self, failure: str | None, table: dict[str, dict[str, Any]], group: Any = None
    ) -> dict[str, dict[str, Any]]:
        """Every rank's file-table entries, merged; raise on every rank if any rank failed.

        Over ``group`` (default: the checkpoint group the training thread uses).
        """
        group = group or self._group
        reports = [(failure, table)]
        if group is not None:
            sent = all_gather_json(
                [failure, table], operation=_TABLES, timeout_s=self.timeout_s, group=group
            )
            reports = parse_each(sent, _report, operation=_TABLES)
        found = list(dict.fromkeys(f for f, _ in reports if f))  # DCP's: the same on every rank
        if found:
            raise CheckpointError(f"{_FAILED}: " + "; ".join(found))
        merged: dict[str, dict[str, Any]] = {}
        for _, entries in reports:
            merged |= entries
        return merged

    def _raise_everywhere(self) -> None:
        """Finish a pending save on every rank; if it failed anywhere, every rank raises."""
        message = None
        try:
            self.wait()
        except CheckpointError as exc:
            message = str(exc)
            self._unreported = None  # never committed
        self._agree(message, CheckpointError)
        self._report_committed()

    def _agree(self, message: str | None, kind: type[Exception]) -> None:
        """Raise ``kind`` on every rank with each rank's ``message`` (once each), if any has one."""
        if self._group is not None:
            sent = all_gather_json(
                message, operation=_VERDICTS, timeout_s=self.timeout_s, group=self._group
            )
            messages = parse_each(sent, _message, operation=_VERDICTS)
            found = list(dict.fromkeys(m for m in messages if m))  # each once, in rank order
            message = "; ".join(found) if found else None
        if message is not None:
            raise kind(message)

    def _finish(
        self,
        tmp: store.Location,
        final: store.Location,
        meta: dict[str, Any],
        files: dict[str, Any],
        table: dict[str, dict[str, Any]],
    ) -> None:
        """The main rank writes its files and commits (a blocking save)."""
        try:
            table = table | formats.write_files(tmp, files)
            self.store.commit(tmp, final, meta, table)
            self.store.prune(self.keep)
        except BaseException as exc:  # surfaced by wait() on the training thread
            self._fail(exc, tmp, files)

    def _background(
        self,
        tmp: store.Location,
        final: store.Location,
        meta: dict[str, Any],
        written: formats.Written,
        table: dict[str, dict[str, Any]],
    ) -> None:
        """An asynchronous save's thread, on every rank: finish this rank's writes,
        share their file-table entries, and the main rank commits."""
        failure, mine = None, {}
        try:
            if written.pending is not None:
                mine = written.pending()
            if self.par.is_main:
                mine |= formats.write_files(tmp, written.files)
        except BaseException as exc:  # DCP's CheckpointException is not an Exception
            failure = _failure(exc, self.par.rank, lambda e: self._why(e, tmp, written.files))
        try:
            table = table | self._gather_table(failure, mine, group=self._bg_group)
            if self.par.is_main:
                self.store.commit(tmp, final, meta, table)
                self.store.prune(self.keep)
        except BaseException as exc:  # surfaced by wait() on the training thread
            self._fail(exc, tmp, written.files)

    def _why(self, exc: BaseException, tmp: store.Location, files: Any = None) -> str:
        return self.store.failure(exc, tmp, files)

    def _fail(self, exc: BaseException, tmp: store.Location, files: dict[str, Any]) -> None:
        """Keep a save's error for :meth:`wait`; the main rank removes the partial directory."""
        error = exc
        if isinstance(exc, Exception) and not isinstance(exc, CheckpointError):
            error = CheckpointError(self._why(exc, tmp, files))
            error.__cause__ = exc
        self._error = error
        if self.par.is_main:
            self.store.discard(tmp)  # at once: it may be what filled the disk

    def wait(self) -> None:
        """Block until this rank's part of an asynchronous save is done (and raise its error).

        On the main rank that is the commit; the other ranks' part ends when
        every file table has reached the main rank.
        """
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._error is not None:
            error, self._error = self._error, None
            text = str(error)
            if not text.startswith(_FAILED):
                text = f"{_FAILED}: {text}"
            raise CheckpointError(text) from error

    def _meta(self, state: TrainState) -> dict[str, Any]:
        """``meta.json``'s content for ``state`` (which is left as it is)."""
        epoch, position = state.epoch, None
        if self.loader is not None:  # the loader knows the epoch it is really in
            where = self.loader.state_dict()
            epoch = where["epoch"]
            position = where | {
                "world": self.par.world_size,
                "batch_size": self.loader.batch_size or 0,
            }
        from manygpu._version import __version__
        from manygpu.weights.save import tie_table

        return {
            "step": state.step,
            "epoch": epoch,
            # A copy: an asynchronous save writes it while the loop goes on.
            "extra": dict(state.extra),
            "loader": position,
            "world_size": self.par.world_size,
            "strategy": self.parts.strategy,
            "format": self.parts.format.name,
            "precision": self.parts.precision,
            # Tied names (dropped -> kept): an export writes each tensor once.
            "tied": tie_table(self.parts.model),
            "manygpu": __version__,
            "torch": torch.__version__,
            # The tracked run (par.log) and its last step: a resume continues it.
            "tracking": self.par.job_state.tracking(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }

    # -- the loop hook ----------------------------------------------------------
    def after_step(self, state: TrainState) -> None:
        """Call after each optimizer step: periodic saves, and save-and-exit on SIGTERM."""
        par = self.par
        par.job_state.note_step(state.step)
        signum = self._preemption.agreed(
            device=par.device, world_size=par.world_size, timeout_s=par.timeout_s
        )
        if signum is not None:
            self.save(state)
            self.wait()
            name = signal.Signals(signum).name
            par.print(f"manygpu: {name}: saved step {state.step} to {self.root}; exiting")
            if wants_requeue(self.requeue, signum, envmod.current()) and par.is_main:
                requeue_slurm_job()
            par.close()
            exit_now(0)
        if self.every and state.step % self.every == 0:
            self.save(state)

    # -- resuming ---------------------------------------------------------------
    def resume(self, which: str | int | Path = "latest", *, fresh_ok: bool = False) -> TrainState:
        """Load a checkpoint and return its counters (a fresh state when there is none).

        ``"latest"`` takes the newest checkpoint that verifies (sizes and checksums);
        each corrupt one it skips is renamed ``corrupt-step-N`` and named in a
        warning, so it never outranks what this run saves (:mod:`.corrupt`). A
        step number or a path must verify or raise :class:`CheckpointError`
        naming the bad file. When checkpoints exist but none verifies,
        starting again from step 0 would silently throw the run away: that
        raises, naming them, unless ``fresh_ok=True``. A resume that loads
        something says so in one line on the main rank (:mod:`.resumed`).
        """
        self.wait()
        verdict = ("none", "")
        if self.par.is_main:  # the only rank that renames: the others wait for its answer
            try:
                verdict = self._choose(which, fresh_ok)
            except OSError as exc:  # the others must hear of it, not hang in the broadcast
                verdict = ("error", f"cannot read the checkpoints in {self.root}: {exc}")
        verdict = self._broadcast_verdict(verdict)  # the main rank's files decide
        kind, value = verdict
        if kind == "error":
            raise CheckpointError(value)
        if kind == "none":
            return TrainState()
        chosen = self.store.location(value)
        with self._local_copy(chosen) as path:
            meta = layout.read_meta(path)
            # The files decide the format, not meta.json (which anyone can edit).
            formats.as_format(formats.detect(path)).read(path, self.parts, group=self._group)
            self._restore_rng(path, meta)
        # The job's step count (par.profile, par.log's step=None) continues from here.
        self.par.job_state.restore(int(meta["step"]), meta.get("tracking"))
        state = TrainState(
            step=int(meta["step"]), epoch=int(meta["epoch"]), extra=dict(meta.get("extra") or {})
        )
        where = None
        if self.loader is not None and meta.get("loader"):
            where = self._restore_loader(meta["loader"])
            state.epoch = where.epoch
        self._barrier()
        done = Resumed(
            path=chosen,
            step=state.step,
            epoch=state.epoch,
            saved_world=int(meta["world_size"]),
            world=self.par.world_size,
            where=where,
        )
        self.par.print(done.line(), markup=False)  # the main rank only
        return state

    @contextlib.contextmanager
    def _local_copy(self, chosen: store.Location) -> Iterator[Path]:
        """``chosen`` as a local directory on every rank (a store's step is downloaded).

        Every rank fetches its own copy; if any rank cannot, every rank raises
        (the others must not go on into the load's collectives and wait).
        """
        with contextlib.ExitStack() as stack:
            message, path = None, Path()
            try:
                path = stack.enter_context(self.store.local_copy(chosen))
            except CheckpointError as exc:
                message = f"rank {self.par.rank}: {exc}"
            except OSError as exc:
                message = f"rank {self.par.rank}: cannot download {chosen}: {exc}"
            self._agree(message, CheckpointError)
            yield path

    def _choose(self, which: str | int | Path, fresh_ok: bool) -> tuple[str, str]:
        if which == "latest":
            # Ray Train restarted the group with a checkpoint kept elsewhere: that one.
            # One of ours is no newer than our own newest verified step, which wins.
            restored = ray_train.restored_checkpoint()
            if restored is not None and not restored.startswith(str(self.root)):
                return corrupt.choose(self.store.location(restored))
            return corrupt.choose_latest(self.root, fresh_ok)
        path = self.store.step(which) if isinstance(which, int) else self.store.location(str(which))
        return corrupt.choose(path)

    def _restore_rng(self, path: Path, meta: dict[str, Any]) -> None:
        file = path / f"rng-rank{self.par.rank}.pt"
        if meta["world_size"] == self.par.world_size and file.is_file():
            rng.restore(formats.load_file(file))
            return
        # Another world size: no saved stream belongs to this rank; derive one.
        self.par.seed_everything((self.parts.seed or 0) + 1000 * int(meta["step"]))

    def _restore_loader(self, saved: dict[str, int]) -> Position:
        assert self.loader is not None
        # On another world size or batch size, the same global samples stay
        # consumed, spread over the new ranks (what that costs is in the line
        # resume prints).
        self.loader.check_resume(saved, world=self.par.world_size)
        where = position(saved, world=self.par.world_size, batch=self.loader.batch_size or 1)
        self.loader.set_epoch(where.epoch, where.batches)
        return where

    def close(self) -> None:
        """Wait for a pending save, then let the snapshot buffers go.

        Under Ray Train every rank first agrees that the last asynchronous save
        committed, then reports it to Ray (a collective: close on every rank).
        """
        try:
            if self._unreported is not None and ray_train.active():
                self._raise_everywhere()
            self.wait()
        finally:
            self._staging.close()


_FAILED = "saving the checkpoint failed"

# What the checkpoint group exchanges, all as JSON (never pickles), checked by structure.
_VERDICT = "checkpoint resume decision"
_TABLES = "checkpoint file tables"
_VERDICTS = "checkpoint save results"


def _verdict(value: Any) -> tuple[str, str]:
    kind, text = value  # a ValueError when it is not a pair
    if kind not in ("ok", "none", "error") or not isinstance(text, str):
        raise TypeError(f"not a resume decision: [{kind!r:.20}, {type(text).__name__}]")
    return kind, text


def _message(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"expected an error message or null, got {type(value).__name__}")
    return value


def _report(value: Any) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """A rank's ``[failure, file-table entries]`` as :meth:`Checkpointer._gather_table` sends it."""
    failure, table = value  # a ValueError when it is not a pair
    entries = isinstance(table, dict) and all(isinstance(e, dict) for e in table.values())
    if not entries:
        raise TypeError("the file table is not an object of objects")
    return _message(failure), table


def _failure(exc: BaseException, rank: int, describe: Callable[[BaseException], str]) -> str:
    """``rank N: what went wrong``, naming the rank where it happened.

    DCP raises one ``CheckpointException`` on every rank, holding each failed
    rank's own error: the first of those is what happened, and where.
    """
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        origin, pair = next(iter(failures.items()))
        cause = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(cause, BaseException):
            rank, exc = int(origin), cause
    return f"rank {rank}: {describe(exc)}"


def _quietly(job: Callable[[], Any]) -> None:
    """Run ``job`` and drop its error (the failed save that left it was reported)."""
    with contextlib.suppress(BaseException):
        job()


def _check_counts(every: Any, keep: Any) -> None:
    for name, value in (("every", every), ("keep", keep)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UsageError(f"Checkpointer({name}={value!r}): give an integer >= 0")
