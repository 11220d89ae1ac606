"""manygpu's metadata between ranks is JSON, checked by structure; debug mode's strict level.

The pure halves of what the gloo tests run: decoding a payload, reading back
an optimizer's layout and a call's description, the debug levels read from
the environment, and the one-line mismatch message strict mode gives.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from manygpu.comm import debug as dbg
from manygpu.comm.objects import PayloadError, all_gather_json, broadcast_json, decode_json
from manygpu.horovod.optimizer_state import (
    _Unsendable,
    describe_state,
    spec_from_json,
    spec_to_json,
    value_from_json,
    value_to_json,
)
from manygpu.horovod.reports import parse_row
from manygpu.runtime import env as envmod


def _wire(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def test_payload_that_is_not_json_names_its_sender() -> None:
    with pytest.raises(PayloadError) as caught:
        decode_json(b"\x80\x04\x95 a pickle", sender=3, operation="probe")
    assert str(caught.value).startswith("rank 0: probe: rank 3 sent a malformed payload (")
    assert "\n" not in str(caught.value) and caught.value.sender == 3


def test_json_collectives_in_one_process_round_trip_as_json() -> None:
    assert all_gather_json({"a": (1, 2)}) == [{"a": [1, 2]}]
    assert broadcast_json(["x", None]) == ["x", None]


def test_optimizer_layout_round_trips_through_json() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    spec = describe_state(opt)
    back = spec_from_json(_wire(spec_to_json(spec)))
    assert back == spec
    assert isinstance(back.options[0]["betas"], tuple)


def test_values_keep_their_types_and_tensors_their_dtype() -> None:
    value = {"lr": torch.tensor(0.05), "steps": [1, (2, 3)], "none": None, "nan": float("inf")}
    back = value_from_json(_wire(value_to_json(value, "v")), "v")
    assert back["steps"] == [1, (2, 3)] and back["none"] is None and back["nan"] == float("inf")
    assert back["lr"].dtype == torch.float32 and back["lr"].item() == torch.tensor(0.05).item()
    with pytest.raises(_Unsendable, match=r"option 'fn'\['f'\] is a function"):
        value_to_json({"f": lambda: 0}, "option 'fn'")


def _layout(**fields: Any) -> dict[str, Any]:
    """A valid one-parameter layout with ``fields`` replaced."""
    return {"group_sizes": [1], "options": [{}], "tensors": [], "scalars": []} | fields


@pytest.mark.parametrize(
    "data, words",
    [
        ({"group_sizes": "x"}, "expected an object with group_sizes"),
        (_layout(options=[]), "do not describe the same groups"),
        (_layout(tensors=[[5, "k", [2], "float32", "cpu"]]), "is not [parameter index, key, ...]"),
        (_layout(tensors=[[0, "k", [2], "os.system", "cpu"]]), "tensor entry 'k' of parameter 0"),
        (_layout(options=[{"lr": {"__reduce__": []}}]), "option 'lr' of group 0 is not a tagged"),
        (
            _layout(options=[{"lr": {"Tensor": ["float32", [2], "cpu", [1]]}}]),
            "has values of shape [1], not [2]",
        ),
    ],
)
def test_malformed_layouts_are_refused_by_structure(data: Any, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        spec_from_json(data)
    assert words in str(caught.value)


def test_call_descriptions_are_checked_and_shapes_come_back_as_tuples() -> None:
    row = _wire(["allreduce('x')", [["w", [2, 3], "torch.float32"]]])
    assert parse_row(row, sender=1, operation="op") == (
        "allreduce('x')",
        [("w", (2, 3), "torch.float32")],
    )
    for bad in ([1, None], ["d", [["w", [-1], "f"]]], ["d", "layout"], {"d": 1}):
        with pytest.raises(PayloadError, match="rank 2 sent a malformed payload"):
            parse_row(bad, sender=2, operation="op")


@pytest.mark.parametrize(
    "value, enabled, strict",
    [("0", False, False), ("1", True, False), ("strict", True, True), ("2", True, True)],
)
def test_debug_levels(value: str, enabled: bool, strict: bool) -> None:
    env = {"MANYGPU_DEBUG": value}
    assert (envmod.debug_enabled(env), envmod.debug_strict(env)) == (enabled, strict)


def test_strict_mismatch_names_both_call_sites_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dbg.dist, "get_rank", lambda: 1)
    x = torch.ones(4)
    rows = [
        tuple(dbg._fingerprint("all_reduce", x, None, 0, 1, dbg._site(site), True).tolist())
        for site in ("train.py:10", "train.py:12")
    ]
    text = dbg._mismatch_text(rows, [r[: dbg._STRICT] for r in rows], ["at a:10", "at a:12"], True)
    assert text.startswith("rank 1: collective mismatch (MANYGPU_DEBUG=strict")
    assert "rank 0 calls all_reduce(float32[4], arg=0) at a:10 as call #1" in text
    assert "rank 1 calls all_reduce(float32[4], arg=0) at a:12 as call #1" in text
    assert "different lines" in text and "\n" not in text
