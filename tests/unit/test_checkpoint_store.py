"""Checkpoints at fsspec URLs in one process: memory:// and a real S3 server on loopback.

The S3 server is moto's, in a thread of this process on 127.0.0.1
(tests/helpers/s3_server.py). Two ranks against it: tests/distributed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ckpt_job import build, train
from s3_server import S3Server, fresh_url, s3_server

from manygpu import Parallel
from manygpu.checkpoint import CheckpointError, TrainState
from manygpu.checkpoint_io import remote, remote_layout, store
from manygpu.errors import UsageError

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


def _fresh(scheme: str) -> str:
    return fresh_url(scheme, "ckpt")


def _run(directory: str | Path, total: int, every: int, **kw: object):  # type: ignore[no-untyped-def]
    with Parallel(strategy="single") as par:
        return train(par, directory, total, every, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "scheme, fmt, async_save",
    [
        ("memory", "full", False),
        ("s3", "full", False),
        ("s3", "full", True),
        ("s3", "dcp", False),
        ("s3", "dcp", True),
    ],
)
def test_resume_from_a_url_is_bit_identical(
    s3: S3Server, tmp_path: Path, scheme: str, fmt: str, async_save: bool
) -> None:
    url = _fresh(scheme)
    ref_losses, ref_params = _run(tmp_path / "ref", 20, every=0)
    _run(url, 12, every=5, fmt=fmt, async_save=async_save)  # "dies" after step 12
    losses, params = _run(url, 20, every=5, fmt=fmt)  # resumes at step 10
    assert min(losses) == 11
    assert all(losses[s] == ref_losses[s] for s in losses)  # exactly (fp32 on the CPU)
    assert torch.equal(params, ref_params)
    root = remote.connect(url)
    assert [u.name for u in remote_layout.committed(root)] == [
        "step-00000010",
        "step-00000015",
        "step-00000020",
    ]


def _saved(url: str, steps: list[int], keep: int = 3) -> list[remote.Url]:
    with Parallel(strategy="single") as par:
        *_, ckpt = build(par, url, every=0)
        ckpt.keep = keep
        for step in steps:
            ckpt.save(TrainState(step=step))
        ckpt.close()
    return remote_layout.committed(remote.connect(url))


def test_meta_json_is_written_last_and_lists_every_object() -> None:
    url = _fresh("memory")
    (step,) = _saved(url, [4])
    meta = json.loads(step.fs.cat_file((step / "meta.json").path))
    held = remote_layout.objects(step)
    assert set(meta["files"]) == set(held) - {"meta.json"}
    assert {"model.pt", "optim.pt", "extras.pt", "rng-rank0.pt"} <= set(meta["files"])
    assert all(meta["files"][n]["bytes"] == held[n] for n in meta["files"])


def test_a_step_without_meta_json_is_never_counted_and_the_next_save_removes_it() -> None:
    url = _fresh("memory")
    root = remote.connect(url)
    _saved(url, [2])
    half = root / "step-00000009"  # a save that died before its commit
    half.fs.pipe_file((half / "model.pt").path, b"partial")
    assert [u.name for u in remote_layout.committed(root)] == ["step-00000002"]
    with Parallel(strategy="single") as par:
        *_, ckpt = build(par, url, every=0)
        assert ckpt.resume().step == 2  # not 9
        ckpt.save(TrainState(step=3))
        ckpt.close()
    assert not remote_layout.objects(half)
    assert [u.name for u in remote_layout.committed(root)] == ["step-00000002", "step-00000003"]


def test_a_step_whose_sizes_differ_is_skipped_set_aside_and_named() -> None:
    url = _fresh("memory")
    _, new = _saved(url, [1, 2])
    new.fs.pipe_file((new / "model.pt").path, b"truncated")
    with pytest.raises(CheckpointError, match=r"model\.pt has 9 bytes"):
        remote_layout.verify(new, hashes=False)
    with Parallel(strategy="single") as par:
        *_, ckpt = build(par, url, every=0)
        with pytest.warns(UserWarning, match="moved it aside to corrupt-step-00000002"):
            assert ckpt.resume().step == 1
        ckpt.close()
    root = remote.connect(url)
    assert [u.name for u in remote_layout.committed(root)] == ["step-00000001"]
    (aside,) = remote_layout.moved_aside(root)
    assert aside.name == "corrupt-step-00000002"
    assert remote_layout.objects(aside)["model.pt"] == 9  # kept, not deleted


def test_a_flipped_byte_fails_the_checksum_on_resume() -> None:
    url = _fresh("memory")
    _, new = _saved(url, [1, 2])
    data = bytearray(new.fs.cat_file((new / "optim.pt").path))
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum sees it
    new.fs.pipe_file((new / "optim.pt").path, bytes(data))
    remote_layout.verify(new, hashes=False)
    with pytest.raises(CheckpointError, match=r"optim\.pt fails its CRC-32 check"):
        remote_layout.verify(new)


def test_pruning_never_removes_the_newest_verified_step() -> None:
    url = _fresh("memory")
    *_, three = _saved(url, [1, 2, 3], keep=0)  # keep=0: nothing pruned while saving
    three.fs.pipe_file((three / "model.pt").path, b"x")  # the newest is damaged
    gone = remote_layout.prune(remote.connect(url), 1)
    assert [u.name for u in gone] == ["step-00000001"]
    names = [u.name for u in remote_layout.committed(remote.connect(url))]
    assert names == ["step-00000002", "step-00000003"]  # the damaged one is not deleted either


def test_a_url_without_its_backend_names_the_extra() -> None:
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(UsageError, match=r"pip install 'manygpu\[gcs\]'") as err:
        store.open_store("gs://bucket/run")
    assert "\n" not in str(err.value)
    with Parallel(strategy="single") as par, pytest.raises(UsageError, match=r"manygpu\[gcs\]"):
        build(par, "gs://bucket/run", every=0)


def test_storage_options_are_for_urls_only(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="storage_options are for URLs"):
        store.open_store(tmp_path, {"anon": True})


def test_a_missing_bucket_is_one_line_at_construction(s3: S3Server) -> None:
    with Parallel(strategy="single") as par, pytest.raises(UsageError) as err:
        build(par, "s3://no-such-bucket/run", every=0)
    text = str(err.value)
    assert "\n" not in text
    assert "s3://no-such-bucket/run" in text and "does not exist" in text


def test_refused_credentials_are_one_line_at_construction(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moto import settings
    from moto.core.responses import ActionAuthenticatorMixin

    # The server checks keys from now on; "testing" is no key it has issued.
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    url = _fresh("s3")
    with Parallel(strategy="single") as par, pytest.raises(UsageError) as err:
        build(par, url, every=0)
    text = str(err.value)
    assert "\n" not in text and "credentials were refused" in text
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in text


def test_a_transient_store_error_is_retried_and_a_refusal_is_not() -> None:
    target = remote.connect(_fresh("memory")) / "obj"
    calls: list[int] = []

    def flaky(fh: remote.ObjectFile) -> None:
        calls.append(1)
        fh.write(b"abc")
        if len(calls) == 1:
            raise ConnectionError("connection reset by peer")

    from manygpu.checkpoint_io.integrity import hashing_pool

    with hashing_pool() as pool:
        entry = remote.write_object(target, flaky, pool, sleep=lambda s: None)
        assert len(calls) == 2 and entry["bytes"] == 3
        assert target.fs.cat_file(target.path) == b"abc"

        def refused(fh: remote.ObjectFile) -> None:
            calls.append(1)
            raise PermissionError("Access Denied")

        calls.clear()
        with pytest.raises(OSError, match=f"writing {target} failed: Access Denied"):
            remote.write_object(target, refused, pool, sleep=lambda s: None)
        assert len(calls) == 1


def test_a_failed_background_upload_is_named_at_the_next_save_and_not_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = _fresh("memory")
    monkeypatch.setattr(remote, "BACKOFF_S", 0.0)
    real = remote.ObjectFile.write

    def failing(self: remote.ObjectFile, data: object) -> int:
        if self.target.name == "optim.pt":
            raise ConnectionError("the store went away")
        return real(self, data)

    with Parallel(strategy="single") as par:
        *_, ckpt = build(par, url, every=0, async_save=True)
        ckpt.save(TrainState(step=1))
        ckpt.wait()
        monkeypatch.setattr(remote.ObjectFile, "write", failing)
        ckpt.save(TrainState(step=2))  # returns; the upload fails behind it
        with pytest.raises(CheckpointError, match=r"optim\.pt failed: the store went away"):
            ckpt.save(TrainState(step=3))
        monkeypatch.setattr(remote.ObjectFile, "write", real)
        ckpt.close()
    root = remote.connect(url)
    assert [u.name for u in remote_layout.committed(root)] == ["step-00000001"]
    assert not remote_layout.objects(root / "step-00000002")


# botocore's own retries (4 more tries of a 500, with backoff) are switched off
# here, so that what is tested is the retry of the whole object (and fast).
_NO_BOTO_RETRY = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}


def _saved_with(url: str, **options: object) -> None:
    with Parallel(strategy="single") as par:
        model, opt, *_ = build(par, _fresh("memory"), every=0)
        from manygpu.checkpoint import Checkpointer

        ckpt = Checkpointer(
            par, url, model=model, optimizer=opt, storage_options=_NO_BOTO_RETRY, **options
        )
        try:
            ckpt.save(TrainState(step=1))
        finally:
            ckpt.close()


def test_puts_the_store_fails_at_first_are_retried_and_the_step_commits(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "BACKOFF_S", 0.0)
    url = _fresh("s3")
    s3.faults.fail_puts("model.pt", 2)  # the 3rd try of the object gets through
    try:
        _saved_with(url)
        assert len(s3.faults.failed) == 2
    finally:
        s3.faults.clear()
    (step,) = remote_layout.committed(remote.connect(url))
    remote_layout.verify(step)  # every checksum


def test_a_store_that_keeps_failing_is_one_error_and_no_committed_step(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "BACKOFF_S", 0.0)
    url = _fresh("s3")
    s3.faults.fail_puts("optim.pt", -1)
    try:
        with pytest.raises(CheckpointError, match=r"optim\.pt failed") as err:
            _saved_with(url)
        assert len(s3.faults.failed) == remote.RETRIES
    finally:
        s3.faults.clear()
    assert "\n" not in str(err.value)
    root = remote.connect(url)
    assert remote_layout.committed(root) == []
    assert remote_layout.objects(root / "step-00000001") == {}  # the partial step removed


def test_inspect_and_export_read_a_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file

    from manygpu.cli.main import main

    monkeypatch.setenv("COLUMNS", "1000")
    url = _fresh("memory")
    with Parallel(strategy="single") as par:
        train(par, url, 9, every=3)
    root = remote.connect(url)
    half = root / "step-00000012"  # a save that never committed
    half.fs.pipe_file((half / "model.pt").path, b"partial")
    assert main(["checkpoint", "inspect", url, "--json"]) == 1  # not all complete
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(r["step"], r["state"], r["format"]) for r in listed] == [
        (3, "complete", "full"),
        (6, "complete", "full"),
        (9, "complete", "full"),
        (12, "incomplete", "full"),
    ]
    assert [(r["epoch"], r["sample"], r["world_size"]) for r in listed[:3]] == [
        (0, 12, 1),
        (0, 24, 1),
        (0, 36, 1),
    ]
    step9 = f"{url}/step-00000009"
    assert main(["checkpoint", "inspect", step9, "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["status"] == "ok" and one["step"] == 9 and one["path"] == str(root / "step-00000009")
    out = tmp_path / "w.safetensors"
    assert main(["checkpoint", "export", url, str(out), "--step", "6"]) == 0
    assert "from memory://" in capsys.readouterr().out
    step6 = root / "step-00000006"
    with store.UrlStore(step6).local_copy(step6) as local:
        want = torch.load(local / "model.pt", weights_only=True)
    got = load_file(str(out))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert main(["checkpoint", "export", url, str(tmp_path / "x.safetensors"), "--step", "4"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of step 4 in memory://" in err and "steps 3, 6, 9" in err
