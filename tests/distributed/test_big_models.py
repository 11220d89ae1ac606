"""A model built empty, loaded into shards, saved from them and loaded back (gloo ranks).

- ``par.save_weights`` from FSDP shards after training writes Hugging Face's
  sharded layout, which loads with ``weights=`` into another strategy, into one
  plain process, and (a Llama) with ``from_pretrained``: equal to the last bit.
- Bad weights files fail ``prepare`` with one line, the same on every rank,
  without a hang: missing, unexpected and wrong-shape keys, a pickle, no file.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import preload, run_ranks
from recipes import full_params
from safetensors.torch import load_file, save_file, save_model
from zoo import GPT, ZOO, dataset, hf_llama

from manygpu.weights import load_weights

pytest.importorskip("transformers")
preload("recipes", "zoo", "transformers.models.llama.modeling_llama")

SHARD = 40_000  # bytes: the GPT's 0.2 MB of weights in several files


def _train_save_reload(source: str, out: str) -> dict[str, Any]:
    from manygpu import Parallel

    results: dict[str, Any] = {}
    for name, build in (("gpt", GPT), ("hf_llama", hf_llama)):
        with Parallel(strategy="fsdp", timeout_s=60) as par:
            with par.init_module():
                model = build()
            model = par.prepare(model, weights=f"{source}/{name}.safetensors")
            opt = par.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
            x, y = dataset(name, 4).tensors
            par.backward(ZOO[name].loss(model(x), y))
            opt.step()
            saved = par.save_weights(model, f"{out}/{name}", max_shard_bytes=SHARD)
            if name == "hf_llama" and par.is_main:
                par.unwrap(model).config.save_pretrained(f"{out}/{name}")
            trained = full_params(par.unwrap(model))
        with Parallel(strategy="ddp", timeout_s=60) as par, par.init_module():
            again = build()
        with Parallel(strategy="ddp", timeout_s=60) as par:
            again = par.unwrap(par.prepare(again, weights=f"{out}/{name}"))
            results[name] = {
                "trained": trained,
                "ddp": full_params(again),
                "files": len(saved.files),
            }
    return results


def test_weights_saved_from_shards_load_anywhere_equal(tmp_path: Path) -> None:
    torch.manual_seed(0)
    for name, build in (("gpt", GPT), ("hf_llama", hf_llama)):
        save_model(build(), str(tmp_path / f"{name}.safetensors"))
    out = tmp_path / "saved"
    ranks = run_ranks(_train_save_reload, 2, str(tmp_path), str(out), timeout=240)
    for name, build in (("gpt", GPT), ("hf_llama", hf_llama)):
        trained = ranks[0][name]["trained"]
        assert (
            ranks[0][name]["files"] > 1 and (out / name / "model.safetensors.index.json").is_file()
        )
        for rank in ranks:  # another strategy reads the files back: equal to the last bit
            got = rank[name]["ddp"]
            assert set(got) == set(trained) and all(torch.equal(got[k], trained[k]) for k in got)
        plain = build()
        load_weights(plain, out / name)  # one plain process
        assert all(torch.equal(p, trained[k]) for k, p in full_params(plain).items())
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(out / "hf_llama")
    assert all(
        torch.equal(p, ranks[0]["hf_llama"]["trained"][k]) for k, p in full_params(hf).items()
    )


def _prepare_each(paths: list[str]) -> list[str]:
    from manygpu import Parallel

    errors = []
    for path in paths:
        with Parallel(strategy="fsdp", timeout_s=60) as par:
            with par.init_module():
                model = GPT()
            try:
                par.prepare(model, weights=path)
                errors.append("no error")
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
    return errors


class _Marker:
    def __reduce__(self) -> Any:
        return (Path.touch, (Path("/tmp/manygpu-unpickled-marker"),))


def test_bad_weights_fail_prepare_in_one_line_on_every_rank(tmp_path: Path) -> None:
    good = {k: v.contiguous() for k, v in GPT().state_dict().items() if k != "head.weight"}
    cases = {
        "missing": ({k: v for k, v in good.items() if k != "ln_f.bias"}, "ln_f.bias"),
        "unexpected": ({**good, "extra.weight": torch.zeros(2)}, "extra.weight"),
        "shape": ({**good, "ln_f.bias": torch.zeros(3)}, "ln_f.bias"),
    }
    paths, needles = [], []
    for name, (tensors, needle) in cases.items():
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        paths.append(str(tmp_path / f"{name}.safetensors"))
        needles.append(needle)
    assert load_file(paths[0])  # the files themselves are fine safetensors
    marker = Path("/tmp/manygpu-unpickled-marker")
    marker.unlink(missing_ok=True)
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(_Marker()))
    paths += [str(tmp_path / "pytorch_model.bin"), str(tmp_path / "nowhere.safetensors")]
    needles += ["pickle", "does not exist"]
    ranks = run_ranks(_prepare_each, 2, paths, timeout=180)
    assert not marker.exists()  # nothing was unpickled
    for i, needle in enumerate(needles):
        errors = {rank[i] for rank in ranks}
        assert len(errors) == 1, errors  # the same line on every rank
        (error,) = errors
        assert error.startswith("CheckpointError") and needle in error and "\n" not in error
