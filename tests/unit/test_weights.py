"""Weights into and out of a model as safetensors, in one process (manygpu.weights).

Round trips are exact (``torch.equal``): loading copies values, a cast aside.
The multi-rank layouts (FSDP2, HSDP, tensor parallel, both) are in
tests/distributed/test_weights_ranks.py.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from manygpu.errors import CheckpointError
from manygpu.weights import load_weights, save_weights, state_names


class Tied(nn.Module):
    """Embedding and head share one weight; a persistent and a non-persistent buffer."""

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(dim, dtype=torch.float32))
        self.register_buffer("cache", torch.zeros(4), persistent=False)


def _fresh(seed: int) -> Tied:
    torch.manual_seed(seed)
    return Tied()


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _fill_buffers(model: Tied) -> None:
    model.scale.uniform_()  # a loaded buffer must differ from its initial value


# -- round trips ---------------------------------------------------------------------
def test_a_safetensors_file_round_trips_with_tied_weights_once(tmp_path: Path) -> None:
    model, other = _fresh(0), _fresh(1)
    _fill_buffers(model)
    out = tmp_path / "w.safetensors"
    written = save_weights(model, out)
    stored = load_file(str(out))
    assert "embed.weight" in stored and "head.weight" not in stored  # tied: first name
    assert "cache" not in stored and written.tensors == len(stored) == 10
    assert not _same(model, other)
    report = load_weights(other, out)
    assert _same(model, other) and other.head.weight is other.embed.weight
    assert report.tensors == 10 and report.bytes_read == out.stat().st_size - _header(out)
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temporary left


def _metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return dict(handle.metadata())


def test_save_weights_records_the_tied_names_it_drops(tmp_path: Path) -> None:
    """As ``safetensors.torch.save_model`` does: ``{dropped: kept}`` in the metadata."""
    save_weights(_fresh(0), tmp_path / "w.safetensors")
    assert _metadata(tmp_path / "w.safetensors")["head.weight"] == "embed.weight"
    save_weights(_fresh(0), tmp_path / "hf", max_shard_bytes=600)
    for part in sorted((tmp_path / "hf").glob("model-*.safetensors")):
        assert _metadata(part)["head.weight"] == "embed.weight"


def test_export_of_a_tied_dcp_checkpoint_keeps_one_copy(tmp_path: Path) -> None:
    """DCP stores a tied tensor under each name; the checkpoint's ``tied`` table drops one."""
    from manygpu import Parallel
    from manygpu.checkpoint import Checkpointer, TrainState
    from manygpu.checkpoint.export import export_safetensors

    model = _fresh(0)
    with Parallel(strategy="single") as par:
        Checkpointer(par, tmp_path / "ck", model=par.prepare(model), format="dcp").save(
            TrainState(step=1)
        )
    out = tmp_path / "w.safetensors"
    summary = export_safetensors(tmp_path / "ck", out)
    assert summary["tied"] == {"head.weight": "embed.weight"} and summary["tensors"] == 10
    stored = load_file(str(out))
    assert "head.weight" not in stored and set(stored) == set(model.state_dict()) - {"head.weight"}
    assert summary["bytes"] == out.stat().st_size
    other = _fresh(1)
    load_weights(other, out)
    assert _same(model, other) and other.head.weight is other.embed.weight


def test_a_failed_write_keeps_the_library_s_whole_reason(tmp_path: Path) -> None:
    """safetensors' messages start with an empty line: the first line alone said nothing."""
    from manygpu.weights.sharded_files import _why

    exc = ValueError("\n            Some tensors share memory,\n            this will lead to ...")
    line = _why(tmp_path / "m.safetensors", exc)
    assert "Some tensors share memory, this will lead to ..." in line and "\n" not in line
    assert "writable path" not in line  # not the path's fault
    disk = _why(tmp_path / "m.safetensors", OSError(28, "No space left on device"))
    assert "(No space left on device); give a writable path" in disk


def _header(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def test_a_sharded_directory_has_hugging_face_s_index(tmp_path: Path) -> None:
    model, other = _fresh(0), _fresh(1)
    written = save_weights(model, tmp_path / "hf", max_shard_bytes=600)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 2 and files == sorted(written.files)
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    stored = {k: v for f in files for k, v in load_file(str(tmp_path / "hf" / f)).items()}
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in stored.values())
    assert set(index["weight_map"].values()) == set(files)
    assert all(k in load_file(str(tmp_path / "hf" / f)) for k, f in index["weight_map"].items())
    load_weights(other, tmp_path / "hf")
    assert _same(model, other)


def test_saving_into_a_directory_keeps_other_files_and_drops_stale_shards(tmp_path: Path) -> None:
    model, other = _fresh(0), _fresh(1)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    save_weights(model, out, max_shard_bytes=600)
    save_weights(other, out)  # now small enough for one file
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    back = _fresh(2)
    load_weights(back, out)
    assert _same(back, other)


def test_a_bf16_file_loads_into_fp32_parameters(tmp_path: Path) -> None:
    model, other = _fresh(0), _fresh(1)
    save_weights(model, tmp_path / "w.safetensors", dtype=torch.bfloat16)
    assert {v.dtype for v in load_file(str(tmp_path / "w.safetensors")).values()} == {
        torch.bfloat16
    }
    load_weights(other, tmp_path / "w.safetensors")
    assert other.embed.weight.dtype == torch.float32
    assert torch.equal(other.embed.weight, model.embed.weight.bfloat16().float())


def test_a_file_holding_both_tied_names_loads(tmp_path: Path) -> None:
    model, other = _fresh(0), _fresh(1)
    state = {k: v.clone() for k, v in model.state_dict().items()}  # both names, cloned
    save_file(state, str(tmp_path / "w.safetensors"))
    load_weights(other, tmp_path / "w.safetensors")
    assert _same(model, other)


# -- a pipeline stage ----------------------------------------------------------------
class _Stage(nn.Module):
    """The last stage of a pipelined Tied: its own untied copy of the head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)


def test_a_stage_is_judged_against_the_whole_model(tmp_path: Path) -> None:
    whole = _fresh(0)
    save_weights(whole, tmp_path / "w.safetensors")
    stage = _Stage()
    report = load_weights(stage, tmp_path / "w.safetensors", expected=state_names(whole))
    assert report.tensors == 3  # norm.weight, norm.bias, and head.weight from embed.weight
    assert torch.equal(stage.head.weight, whole.embed.weight)
    assert torch.equal(stage.norm.weight, whole.norm.weight)
    partial = {k: v for k, v in load_file(str(tmp_path / "w.safetensors")).items()}
    del partial["blocks.1.bias"]  # another stage's tensor: still missing for the model
    save_file(partial, str(tmp_path / "p.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks 1 of the model's tensors \(blocks.1.bias\)"):
        load_weights(stage, tmp_path / "p.safetensors", expected=state_names(whole))


# -- Hugging Face models -------------------------------------------------------------
def _llama(tie: bool, seed: int, base: bool = False) -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      tie_word_embeddings=tie)  # fmt: skip
    torch.manual_seed(seed)
    cls = transformers.LlamaModel if base else transformers.LlamaForCausalLM
    return cls(config)


@pytest.mark.parametrize("tie", [True, False])
def test_hugging_face_files_load_and_save_exactly(tmp_path: Path, tie: bool) -> None:
    model, other = _llama(tie, 0), _llama(tie, 1)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert not _same(model, other)
    load_weights(other, tmp_path / "hf")
    assert _same(model, other)
    assert (other.lm_head.weight is other.model.embed_tokens.weight) is tie
    save_weights(model, tmp_path / "mine", max_shard_bytes=100_000)
    assert (tmp_path / "mine" / "model.safetensors.index.json").is_file()
    model.config.save_pretrained(tmp_path / "mine")
    back = type(model).from_pretrained(tmp_path / "mine")
    assert _same(model, back)
    stored = json.loads((tmp_path / "mine" / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in stored["weight_map"]) is not tie


@pytest.mark.parametrize("tie", [True, False])
def test_a_head_model_s_file_loads_into_its_base_model(tmp_path: Path, tie: bool) -> None:
    head, base = _llama(tie, 0), _llama(tie, 1, base=True)
    head.save_pretrained(tmp_path / "hf", safe_serialization=True)
    report = load_weights(base, tmp_path / "hf")  # model.layers.0... -> layers.0...
    assert report.tensors == len(base.state_dict())
    assert _same(head.model, base)


def test_a_base_model_s_file_loads_into_a_head_model_when_tied(tmp_path: Path) -> None:
    base, head = _llama(True, 0, base=True), _llama(True, 1)
    save_weights(base, tmp_path / "base.safetensors")
    load_weights(head, tmp_path / "base.safetensors")  # layers.0... -> model.layers.0...
    assert _same(base, head.model) and head.lm_head.weight is head.model.embed_tokens.weight
    untied = _llama(False, 1)
    with pytest.raises(CheckpointError, match=r"lacks 1 .*\(lm_head.weight\)"):
        load_weights(untied, tmp_path / "base.safetensors")


# -- manygpu checkpoints -------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["full", "dcp"])
def test_a_manygpu_checkpoint_loads_by_its_root(tmp_path: Path, fmt: str) -> None:
    from manygpu import Parallel
    from manygpu.checkpoint import Checkpointer, TrainState

    model, other = _fresh(0), _fresh(1)
    with Parallel(strategy="single") as par:
        prepared = par.prepare(model)
        ckpt = Checkpointer(par, tmp_path / "ck", model=prepared, format=fmt)
        ckpt.save(TrainState(step=3))
        with torch.no_grad():
            model.norm.weight.add_(1)
        ckpt.save(TrainState(step=5))
    report = load_weights(other, tmp_path / "ck")  # the newest good step
    assert report.source.endswith("step-00000005") and _same(model, other)


# -- bad input: one line, nothing unpickled ------------------------------------------
def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


def _with(tmp_path: Path, change: Any) -> Path:
    state = {k: v.clone() for k, v in _fresh(0).state_dict().items() if k != "head.weight"}
    change(state)
    save_file(state, str(tmp_path / "bad.safetensors"))
    return tmp_path / "bad.safetensors"


BAD = [
    (lambda s: [s.pop(f"blocks.{i}.weight") for i in range(3)] and s.pop("scale"),
     # in state-dict order: the root's own buffer first
     r"lacks 4 of the model's tensors \(scale, blocks.0.weight, blocks.1.weight \(and 1 more\)\)"),
    (lambda s: s.update(extra=torch.zeros(2)), r"holds 1 the model has no place for \(extra\)"),
    (lambda s: s.update({"norm.weight": torch.zeros(9)}),
     r"norm.weight is \[9\] in the file but \[8\] in the model"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "needle"), BAD, ids=["missing", "unexpected", "shape"])
def test_a_file_that_does_not_fit_is_one_line(tmp_path: Path, change: Any, needle: str) -> None:
    model = _fresh(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as exc:
        load_weights(model, _with(tmp_path, change))
    assert re.search(needle, _one_line(exc)), exc.value
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched


class _Marker:
    """Unpickling this creates a file: proof that something was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "w.pt", "w.ckpt", "disguised.safetensors"])
def test_a_pickle_is_refused_unread(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "unpickled"
    path = tmp_path / name
    if name.endswith(".pt"):
        torch.save({"w": _Marker(str(marker))}, path)  # torch.save's zip archive
    else:
        path.write_bytes(pickle.dumps({"w": _Marker(str(marker))}))
    for target in (path, tmp_path) if name == "pytorch_model.bin" else (path,):
        with pytest.raises(CheckpointError) as exc:
            load_weights(_fresh(0), target)
        text = _one_line(exc)
        assert "is a pickle file" in text and "convert it to safetensors" in text
    assert not marker.exists()


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: p / "nope", "does not exist"),
        (lambda p: p, "holds no weights we read"),
        (lambda p: (p / "x.safetensors").write_bytes(b"\x10" + bytes(20)) and p / "x.safetensors",
         "is not a readable safetensors file"),
    ],
    ids=["missing", "empty-dir", "garbage"],
)  # fmt: skip
def test_a_path_that_holds_no_weights_is_one_line(tmp_path: Path, make: Any, needle: str) -> None:
    with pytest.raises(CheckpointError) as exc:
        load_weights(_fresh(0), make(tmp_path))
    assert needle in _one_line(exc)


def test_an_index_that_points_outside_its_directory_is_refused(tmp_path: Path) -> None:
    save_weights(_fresh(0), tmp_path / "elsewhere.safetensors")
    (tmp_path / "hf").mkdir()
    weight_map = {k: "../elsewhere.safetensors" for k in ("embed.weight",)}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    with pytest.raises(CheckpointError) as exc:
        load_weights(_fresh(0), tmp_path / "hf")
    assert "not a file of" in _one_line(exc)


# -- manygpu checkpoint export: the same streaming writer ------------------------------
@pytest.mark.parametrize("fmt", ["full", "dcp"])
def test_export_writes_tied_weights_and_shards_a_directory(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from manygpu import Parallel
    from manygpu.checkpoint import Checkpointer, TrainState
    from manygpu.cli.main import main

    model = _fresh(0)
    with Parallel(strategy="single") as par:
        Checkpointer(par, tmp_path / "ck", model=par.prepare(model), format=fmt).save(
            TrainState(step=1)
        )
    one = tmp_path / "w.safetensors"
    assert main(["checkpoint", "export", str(tmp_path / "ck"), str(one)]) == 0  # tied: once
    assert "head.weight" not in load_file(str(one))  # written once, the name HF keeps
    assert _metadata(one)["head.weight"] == "embed.weight"  # the alias, as save_model does
    assert "tied: head.weight is embed.weight" in capsys.readouterr().out
    out = tmp_path / "hf"
    argv = ["checkpoint", "export", str(tmp_path / "ck"), str(out), "--max-shard-size", "600"]
    assert main(argv) == 0
    assert " files: " in capsys.readouterr().out
    assert (out / "model.safetensors.index.json").is_file()
    for path in (one, out):
        other = _fresh(1)
        load_weights(other, path)
        assert _same(model, other)
    assert main(argv) == 2  # an existing directory is not overwritten
    assert "is a directory that exists" in capsys.readouterr().err


def test_export_refuses_a_size_that_is_not_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from manygpu.cli.main import main

    for size in ("0", "big"):
        with pytest.raises(SystemExit) as exc:
            main(
                [
                    "checkpoint",
                    "export",
                    str(tmp_path),
                    str(tmp_path / "o"),
                    "--max-shard-size",
                    size,
                ]
            )
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and "--max-shard-size" in err and "\n" not in err, err


def test_a_safetensors_file_is_not_taken_for_a_pickle_by_its_first_byte(tmp_path: Path) -> None:
    """A header of 128 + 256k bytes starts the file with 0x80, pickle's first byte."""
    model, other = _fresh(0), _fresh(1)
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    for pad in range(300):
        save_file(state, str(tmp_path / "w.safetensors"), metadata={"pad": "x" * pad})
        if (tmp_path / "w.safetensors").read_bytes()[0] == 0x80:
            break
    assert (tmp_path / "w.safetensors").read_bytes()[0] == 0x80
    load_weights(other, tmp_path / "w.safetensors")
    assert _same(model, other)
