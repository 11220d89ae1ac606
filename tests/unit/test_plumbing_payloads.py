"""What the checkpoint, pipeline and doctor send between ranks round-trips as JSON,
and anything of another structure is one :class:`PayloadError` line naming the sender.

The pure halves of ``tests/distributed/test_plumbing_no_pickle.py``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from manygpu.checkpoint.manager import _message, _report, _verdict
from manygpu.comm.objects import PayloadError, parse_each
from manygpu.doctor.facts import Facts, GPUFacts, PairResult, SystemFacts, TorchFacts
from manygpu.doctor.live import _exit_code, _node_and_facts, _pair_dicts
from manygpu.strategies.pipeline.strategy import _dtype_name, _output_meta


def _wire(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def _refused(parse: Callable[[Any], Any], payload: Any, sender: int = 0) -> str:
    with pytest.raises(PayloadError) as caught:
        parse_each([_wire(payload)], parse, operation="probe", first_sender=sender)
    text = str(caught.value)
    assert text.startswith(f"rank 0: probe: rank {sender} sent a malformed payload (")
    assert "\n" not in text and caught.value.sender == sender
    return text


def test_parse_each_names_each_sender_from_the_first() -> None:
    assert parse_each([1, 2], _exit_code, operation="probe", first_sender=4) == [1, 2]
    with pytest.raises(PayloadError, match="rank 5 sent"):
        parse_each([1, "2"], _exit_code, operation="probe", first_sender=4)


def test_checkpoint_decisions_and_tables_round_trip() -> None:
    for verdict in [("none", ""), ("ok", "/ck/step-00000004"), ("error", "no good checkpoint")]:
        assert parse_each([_wire(verdict)], _verdict, operation="probe") == [verdict]
    table = {"model.pt": {"bytes": 12, "crc32": "0a1b2c3d"}}
    for report in [(None, table), ("rank 1: disk full", {})]:
        assert parse_each([_wire(report)], _report, operation="probe") == [report]
    assert parse_each(_wire([None, "rank 1: disk full"]), _message, operation="p")[1] == (
        "rank 1: disk full"
    )


@pytest.mark.parametrize(
    ("parse", "payload"),
    [
        (_verdict, ["run", "x"]),
        (_verdict, ["ok", 3]),
        (_verdict, ["ok"]),
        (_verdict, {"ok": "x"}),
        (_report, [None, {"model.pt": 12}]),
        (_report, [None, ["model.pt"]]),
        (_report, [7, {}]),
        (_message, {"text": "x"}),
    ],
)
def test_checkpoint_payloads_of_another_structure_are_refused(
    parse: Callable[[Any], Any], payload: Any
) -> None:
    _refused(parse, payload, sender=1)


def test_pipeline_output_meta_round_trips_with_its_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        sent = [[4, 3], _dtype_name(dtype)]
        assert parse_each([_wire(sent)], _output_meta, operation="p") == [([4, 3], dtype)]


@pytest.mark.parametrize(
    "payload",
    [
        [[4, 3], "os.system"],
        [[4, 3], "Tensor"],
        [[4, 3], "__class__"],
        [[4, -1], "float32"],
        [[4, True], "float32"],
        [[4.0], "float32"],
        ["4x3", "float32"],
        None,
    ],
)
def test_pipeline_output_meta_of_another_structure_is_refused(payload: Any) -> None:
    _refused(_output_meta, payload, sender=1)


def _facts() -> Facts:
    return Facts(
        system=SystemFacts(hostname="node-a", cpus=8, memory_bytes=2**34),
        torch=TorchFacts(version="2.13.0", arch_list=["sm_90"]),
        gpus=[GPUFacts(index=0, name="H100", power_w=312.5)],
        env={"NCCL_DEBUG": "INFO"},
    )


def test_doctor_facts_and_pairs_round_trip() -> None:
    facts = _facts()
    [(node, back)] = parse_each([_wire([3, facts.to_dict()])], _node_and_facts, operation="p")
    assert node == 3 and back == facts
    pairs = [
        vars(PairResult(a=0, b=1, seconds=0.25, gbps=4.0)),
        vars(PairResult(a=0, b=2, error="recv[src=2] did not complete within 20s")),
    ]
    assert parse_each([_wire(pairs)], _pair_dicts, operation="p") == [pairs]


@pytest.mark.parametrize(
    ("parse", "payload"),
    [
        (_node_and_facts, [0]),
        (_node_and_facts, ["0", {}]),
        (_node_and_facts, [0, {"torch": {"version": "2"}}]),  # no system
        (_node_and_facts, [0, {"system": [], "torch": {"version": "2"}}]),
        (_node_and_facts, [0, {"system": {"hostname": ["x"]}, "torch": {"version": "2"}}]),
        (_pair_dicts, {"a": 0, "b": 1}),
        (_pair_dicts, [{"a": 0, "b": 1, "shell": "rm"}]),
        (_pair_dicts, [{"a": 0}]),
        (_pair_dicts, [{"a": "0", "b": 1}]),
        (_pair_dicts, [{"a": 0, "b": 1, "seconds": "fast"}]),
        (_pair_dicts, [{"a": 0, "b": 1, "error": 5}]),
        (_exit_code, "0"),
        (_exit_code, True),
    ],
)
def test_doctor_payloads_of_another_structure_are_refused(
    parse: Callable[[Any], Any], payload: Any
) -> None:
    _refused(parse, payload, sender=2)


def test_facts_have_no_tuples_to_lose_on_the_wire() -> None:
    """JSON has no tuples: every field of the facts the doctor sends is a list or scalar."""
    data = _facts().to_dict()
    assert _wire(data) == data
    assert dataclasses.asdict(Facts.from_dict(_wire(data))) == data
