"""Weights read from object-store URLs in one process: memory:// and a real S3 server.

The S3 server is moto's, in a thread of this process on 127.0.0.1
(tests/helpers/s3_server.py). Loads are compared with loading the local copy
exactly (``torch.equal``: loading copies values). The reads themselves are
recorded at the filesystem (memory://'s ``cat_file``): a rank's block of rows is
one ranged request of exactly its bytes, and a whole load fetches the tensors'
bytes once plus the header, never the file again. Two ranks under FSDP:
tests/distributed/test_weights_ranks.py.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from s3_server import S3Server, fresh_url, s3_server
from safetensors.torch import save_file
from torch import nn

from manygpu import Parallel
from manygpu.checkpoint import Checkpointer, TrainState
from manygpu.checkpoint_io import remote
from manygpu.errors import CheckpointError, UsageError
from manygpu.weights import load_weights, save_weights, st_read
from manygpu.weights.url_sources import open_url_source

pytest.importorskip("s3fs")
pytest.importorskip("moto")


class Net(nn.Module):
    """An embedding of 160 KiB (more than the header probe), tied to the head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(640, 64)
        self.proj = nn.Linear(64, 64)
        self.head = nn.Linear(64, 640, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("step", torch.tensor(7, dtype=torch.int64))


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


def _prefix(scheme: str) -> str:
    return fresh_url(scheme, "weights")


def _upload(local: Path, url: str) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    if local.is_dir():
        for file in sorted(local.iterdir()):
            fs.pipe_file(f"{path}/{file.name}", file.read_bytes())
    else:
        fs.pipe_file(path, local.read_bytes())


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any, Any]]:
    """Every ``cat_file`` on memory:// (what ranged reads come down to): path, start, end."""
    seen: list[tuple[str, Any, Any]] = []
    real = MemoryFileSystem.cat_file

    def recording(self: Any, path: str, start: Any = None, end: Any = None, **kw: Any) -> Any:
        seen.append((path, start, end))
        return real(self, path, start=start, end=end, **kw)

    monkeypatch.setattr(MemoryFileSystem, "cat_file", recording)
    return seen


# -- the same values as from disk -------------------------------------------------------
@pytest.mark.parametrize("scheme", ["memory", "s3"])
@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_a_url_loads_exactly_what_the_local_copy_does(
    s3: S3Server, tmp_path: Path, scheme: str, layout: str
) -> None:
    model = _net(0)
    local = tmp_path / ("w.safetensors" if layout == "file" else "hf")
    save_weights(model, local, **({} if layout == "file" else {"max_shard_bytes": 60_000}))
    url = _prefix(scheme) + ("/w.safetensors" if layout == "file" else "/hf")
    _upload(local, url)
    if layout == "sharded":
        assert len(list(local.glob("*.safetensors"))) > 2
    from_disk, from_url = _net(1), _net(2)
    load_weights(from_disk, local)
    report = load_weights(from_url, url)
    assert _same(from_url, model) and _same(from_disk, from_url)
    assert from_url.head.weight is from_url.embed.weight
    assert report.source == str(remote.connect(url))  # memory:// names it memory:///...


def test_a_block_of_rows_is_one_ranged_request_of_its_bytes(
    tmp_path: Path, requests: list[tuple[str, Any, Any]]
) -> None:
    model = _net(0)
    save_weights(model, tmp_path / "w.safetensors")
    url = _prefix("memory") + "/w.safetensors"
    _upload(tmp_path / "w.safetensors", url)
    source = open_url_source(remote.connect(url))
    assert requests == [(remote.connect(url).path, 0, st_read.HEADER_PROBE)]  # the header
    requests.clear()
    rows = source.read("embed.weight", (slice(100, 260), slice(None)))  # type: ignore[attr-defined]
    assert torch.equal(rows, model.embed.weight[100:260])
    _, begin = source._layout(source.files["embed.weight"])["embed.weight"]  # type: ignore[attr-defined]
    row = 64 * 4
    assert [(s, e) for _, s, e in requests] == [(begin + 100 * row, begin + 260 * row)]
    source.close()


def test_a_whole_load_fetches_each_tensor_once_and_the_header(
    tmp_path: Path, requests: list[tuple[str, Any, Any]]
) -> None:
    save_weights(_net(0), tmp_path / "w.safetensors")
    size = (tmp_path / "w.safetensors").stat().st_size
    url = _prefix("memory") + "/w.safetensors"
    _upload(tmp_path / "w.safetensors", url)
    requests.clear()
    load_weights(_net(1), url)
    assert all(s is not None and e is not None for _, s, e in requests)  # never the whole object
    header = 8 + int.from_bytes((tmp_path / "w.safetensors").read_bytes()[:8], "little")
    after_probe = sum(e - s for _, s, e in requests[1:])
    assert after_probe == size - header  # every tensor's bytes once
    assert size > 2 * st_read.HEADER_PROBE


def test_a_long_range_is_fetched_in_pieces(
    tmp_path: Path, requests: list[tuple[str, Any, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(st_read, "PIECE_BYTES", 10_000)
    monkeypatch.setattr(st_read, "PIECES_AT_ONCE", 3)
    model = _net(0)
    save_weights(model, tmp_path / "w.safetensors")
    url = _prefix("memory") + "/w.safetensors"
    _upload(tmp_path / "w.safetensors", url)
    other = _net(1)
    load_weights(other, url)
    assert _same(model, other)
    assert max(e - s for _, s, e in requests[1:]) == 10_000


# -- checkpoints at a URL ---------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["full", "dcp"])
def test_a_checkpoint_at_a_url_loads_by_its_root_and_its_step(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    url = _prefix("memory") + "/run"
    model = _net(0)
    with Parallel(strategy="single") as par:
        prepared = par.prepare(model)
        ckpt = Checkpointer(par, url, model=prepared, format=fmt)
        ckpt.save(TrainState(step=3))
        ckpt.close()
    for where in (url, url + "/step-00000003"):
        other = _net(1)
        report = load_weights(other, where)
        assert _same(model, other), where
        assert report.source == str(remote.connect(url + "/step-00000003"))
    assert list(tmp_path.glob("manygpu-weights-*")) == []  # each downloaded copy is deleted


# -- prepare(weights=URL, weights_options=...) ------------------------------------------
def test_prepare_reads_a_url_with_its_storage_options(s3: S3Server, tmp_path: Path) -> None:
    model = _net(0)
    save_weights(model, tmp_path / "w.safetensors")
    url = _prefix("s3") + "/w.safetensors"
    _upload(tmp_path / "w.safetensors", url)
    with Parallel(strategy="single") as par:
        with par.init_module():
            empty = Net()
        options = {"endpoint_url": s3.env["AWS_ENDPOINT_URL"], "skip_instance_cache": True}
        prepared = par.prepare(empty, weights=url, weights_options=options)
        assert _same(par.unwrap(prepared), model)
    with Parallel(strategy="single") as par, pytest.raises(UsageError, match="give both"):
        par.prepare(_net(0), weights_options={"anon": True})


def test_a_url_without_its_backend_names_the_extra_before_anything_is_built() -> None:
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(UsageError, match=r"weights URL gs://b/w.safetensors: .*manygpu\[gcs\]"):
        load_weights(_net(0), "gs://b/w.safetensors")
    with Parallel(strategy="single") as par, pytest.raises(UsageError) as err:
        with par.init_module():
            empty = Net()
        par.prepare(empty, weights="gs://b/w.safetensors")
    assert "\n" not in str(err.value) and "manygpu[gcs]" in str(err.value)


def test_storage_options_with_a_local_path_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="storage options are for weights URLs"):
        load_weights(_net(0), tmp_path / "w.safetensors", storage_options={"anon": True})


# -- one line for what is wrong ---------------------------------------------------------
def _error(where: str, **kw: Any) -> str:
    with pytest.raises(CheckpointError) as exc:
        load_weights(_net(0), where, **kw)
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_a_missing_object_bucket_or_index_file_is_one_line(s3: S3Server, tmp_path: Path) -> None:
    for where in (_prefix("memory") + "/nope.safetensors", _prefix("s3") + "/nope.safetensors"):
        assert "does not exist" in _error(where), where
    assert "does not exist" in _error("s3://no-such-bucket/w.safetensors")
    save_weights(_net(0), tmp_path / "hf", max_shard_bytes=60_000)
    gone = sorted((tmp_path / "hf").glob("*.safetensors"))[1]
    gone.unlink()
    url = _prefix("s3") + "/hf"
    _upload(tmp_path / "hf", url)
    assert f"names {gone.name}, which is missing" in _error(url)


def test_refused_credentials_are_one_line(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moto import settings
    from moto.core.responses import ActionAuthenticatorMixin

    save_weights(_net(0), tmp_path / "w.safetensors")
    url = _prefix("s3") + "/w.safetensors"
    _upload(tmp_path / "w.safetensors", url)
    # The server checks keys from now on; "testing" is no key it has issued.
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    text = _error(url, storage_options={"skip_instance_cache": True})
    assert "credentials were refused" in text and url in text
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in text.replace(url, "")


def test_a_pickle_or_garbage_at_a_url_is_refused_unread() -> None:
    base = _prefix("memory")
    fs = fsspec.filesystem("memory")
    fs.pipe_file(base.removeprefix("memory://") + "/pytorch_model.bin", b"\x80\x04junk")
    assert "is a pickle file" in _error(base)
    fs.pipe_file(base.removeprefix("memory://") + "/x.safetensors", b"\x80\x04" + bytes(20))
    assert "is a pickle file" in _error(base + "/x.safetensors")  # by its first bytes
    fs.pipe_file(base.removeprefix("memory://") + "/y.safetensors", b"\x10" + bytes(20))
    assert "is not a readable safetensors file" in _error(base + "/y.safetensors")


# -- the header is checked as safetensors checks it -------------------------------------
def _file(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


_GOOD = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
_BAD = {
    "gap": (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', bytes(8)),
    "wrong size": (b'{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', bytes(8)),
    "overlap": (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                b'"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', bytes(8)),
    "short data": (_GOOD, bytes(4)),
    "long data": (_GOOD, bytes(12)),
    "unknown dtype": (b'{"a":{"dtype":"Q9","shape":[2],"data_offsets":[0,8]}}', bytes(8)),
    "negative shape": (b'{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', bytes(8)),
    "not an object": (b'[1, 2]', b""),
    "not json": (b'{"a":', b""),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_BAD))
def test_a_damaged_header_is_refused_as_safetensors_refuses_it(tmp_path: Path, case: str) -> None:
    from safetensors import safe_open

    header, data = _BAD[case]
    path = tmp_path / "w.safetensors"
    path.write_bytes(_file(header, data))
    # safetensors' own error type varies by case
    with pytest.raises(Exception), safe_open(str(path), framework="pt") as fh:  # noqa: B017
        list(fh.keys())
    assert "is not a readable safetensors file" in _error(str(path))


def test_a_sound_header_matches_what_safetensors_reads(tmp_path: Path) -> None:
    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.tensor(3, dtype=torch.int16),
               "e": torch.empty(0, 4), "f": torch.ones(2, 2, dtype=torch.bfloat16)}  # fmt: skip
    save_file(tensors, str(tmp_path / "w.safetensors"), metadata={"format": "pt"})
    got = st_read.read_header(st_read.LocalRanges(tmp_path / "w.safetensors"))
    assert list(got) == sorted(tensors)
    assert {k: (s.shape, s.dtype) for k, (s, _) in got.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in tensors.items()
    }
    raw = (tmp_path / "w.safetensors").read_bytes()
    for name, (_, offset) in got.items():
        want = tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes()
        assert raw[offset : offset + len(want)] == want, name
