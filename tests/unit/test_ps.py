"""Parameter servers in one process: the split, the wire layouts, options, roles, refusals."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
from jobs import two_rank_cluster
from torch import nn

from manygpu import DDP, PS, Parallel, ParallelConfig, UsageError
from manygpu.launch.resolve import LaunchRequest, resolve
from manygpu.launch.worker import keeper
from manygpu.runtime import env as envmod
from manygpu.strategies import JobOptions, abilities, card, get_strategy, serving_strategy
from manygpu.strategies.ps.links import role_view
from manygpu.strategies.ps.protocol import (
    PUSH,
    HyperLayout,
    Layout,
    Reply,
    balance,
    clip_of,
    fill_request,
    flatten,
    from_bytes,
    to_bytes,
    unflatten_into,
)


# -- the split ---------------------------------------------------------------------
def test_balance_puts_the_largest_first_on_the_least_loaded_server() -> None:
    sizes = [100, 10, 60, 50, 40, 5]
    shards = balance(sizes, 2)
    loads = [sum(sizes[i] for i in shard) for shard in shards]
    # 100 -> s0, 60 -> s1, 50 -> s1 (110), 40 -> s0 (140), 10 -> s1 (120), 5 -> s1 (125).
    assert shards == [(0, 4), (1, 2, 3, 5)] and loads == [140, 125]
    assert sorted(i for shard in shards for i in shard) == list(range(len(sizes)))
    assert balance(sizes, 2) == shards  # the same on every rank
    # Equal sizes alternate; one server takes everything.
    assert balance([4, 4, 4, 4], 2) == [(0, 2), (1, 3)]
    assert balance(sizes, 1) == [tuple(range(6))]


def test_balance_of_a_real_model_is_within_its_largest_tensor() -> None:
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 128), nn.Linear(128, 32))
    sizes = [p.numel() for p in model.parameters()]
    for servers in (2, 3):
        loads = [sum(sizes[i] for i in s) for s in balance(sizes, servers)]
        assert max(loads) - min(loads) <= max(sizes)


# -- what travels --------------------------------------------------------------------
def _adamw() -> torch.optim.Optimizer:
    model = nn.Linear(4, 2)
    return torch.optim.AdamW(
        [
            {"params": [model.weight], "weight_decay": 0.1},
            {"params": [model.bias], "weight_decay": 0.0, "lr": torch.tensor(0.5)},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
    )


def test_every_number_of_every_group_travels_and_lands() -> None:
    worker, server = _adamw(), _adamw()
    layout = HyperLayout.of(worker.param_groups)
    keys = {(g, k) for g, k, _ in layout.slots}
    assert {(0, "lr"), (0, "betas"), (0, "weight_decay"), (1, "lr"), (0, "eps")} <= keys
    assert (0, "amsgrad") not in keys and (0, "foreach") not in keys  # flags stay as built
    # A scheduler's changes on the worker reach the server's groups (tensor lr too).
    worker.param_groups[0]["lr"] = 2e-4
    worker.param_groups[0]["betas"] = (0.8, 0.9)
    worker.param_groups[1]["lr"].fill_(0.25)
    layout.unpack(layout.pack(worker.param_groups), dict(enumerate(server.param_groups)))
    assert server.param_groups[0]["lr"] == 2e-4
    assert server.param_groups[0]["betas"] == (0.8, 0.9)
    assert float(server.param_groups[1]["lr"]) == 0.25
    assert isinstance(server.param_groups[1]["lr"], torch.Tensor)  # stays a tensor


def test_headers_round_trip() -> None:
    layout = Layout(HyperLayout.of(_adamw().param_groups), params=3, workers=2)
    header = fill_request(
        layout.new_request(), PUSH, step=7, clip=(1.0, 2.0), hypers=[0.1] * layout.hypers.size,
        present=[True, False, True],
    )  # fmt: skip
    assert header.numel() == layout.request and float(header[1]) == 7
    assert clip_of(header) == (1.0, 2.0)
    assert layout.presence(header) == [True, False, True]
    assert layout.hyper_values(header) == pytest.approx([0.1] * layout.hypers.size)
    assert clip_of(fill_request(layout.new_request(), PUSH)) is None
    reply = Reply(aux=0, version=12, lag=1, tau=3, norm=0.5, live=2, lags=(1, -1))
    assert Reply.read(reply.write(layout.new_reply())) == reply


def test_flat_tensors_and_state_bytes_round_trip() -> None:
    tensors = [torch.randn(2, 3), torch.randn(4)]
    flat = flatten(tensors, torch.float32)
    targets = [torch.zeros(2, 3), torch.zeros(4)]
    unflatten_into(flat, targets)
    assert all(torch.equal(a, b) for a, b in zip(tensors, targets, strict=True))
    state = {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2)}, 5: {"momentum": 0.9}}
    back = from_bytes(to_bytes(state))
    assert torch.equal(back[0]["exp_avg"], state[0]["exp_avg"]) and back[5] == {"momentum": 0.9}


# -- options, roles, the registry ------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"servers": 0}, "servers"),
        ({"servers": True}, "servers"),
        ({"mode": "hogwild"}, "unknown parameter-server mode"),
        ({"mode": "async", "max_staleness": -1}, "max_staleness"),
        ({"max_staleness": 2}, "mode='async'"),
    ],
)
def test_bad_options_are_one_line(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(UsageError, match=needle) as info:
        PS(**kwargs)
    assert "\n" not in str(info.value)


def test_servers_come_from_the_script_or_the_launcher_and_must_agree() -> None:
    def launched(k: int | None) -> dict[str, str]:
        return {} if k is None else {envmod.PS_SERVERS: str(k)}

    assert PS().launched(launched(None)).servers == 1
    assert PS().launched(launched(3)).servers == 3
    assert PS(servers=2).launched(launched(None)).servers == 2
    with pytest.raises(UsageError, match="launched with --ps 1"):
        PS(servers=2).launched(launched(1))


def test_roles_and_views() -> None:
    cluster = two_rank_cluster()
    role, view = role_view(cluster, 1)
    assert role == "server" and (view.rank, view.world_size) == (0, 1)
    from dataclasses import replace

    role, view = role_view(replace(cluster, rank=1), 1)
    assert role == "worker" and (view.rank, view.world_size, view.is_main) == (0, 1, True)


def test_the_card_and_the_launcher_pick_ps() -> None:
    entry = card("ps")
    assert entry.serves and entry.changes_loop and not entry.one_process  # never "auto"'s pick
    assert entry.comm.grads == "push_pull" and entry.memory.optimizer == "ways"
    assert serving_strategy() == "ps"
    assert ParallelConfig().resolved_strategy(4, served=True) == "ps"
    assert ParallelConfig(strategy="ddp").resolved_strategy(4, served=True) == "ddp"
    assert ParallelConfig().resolved_strategy(4) == "ddp"


def test_a_job_too_small_for_its_servers_is_refused_before_any_group() -> None:
    ps = get_strategy("ps")
    with pytest.raises(UsageError, match="at least 3 processes"):
        ps.validate_world(two_rank_cluster(), PS(servers=2), JobOptions())
    with pytest.raises(UsageError, match="at least 2 processes"):
        Parallel(strategy="ps")  # one process: no worker beside its server


def test_launched_with_ps_but_another_strategy_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(envmod.PS_SERVERS, "1")
    with pytest.raises(UsageError, match=r"launched with --ps 1.*strategy='ps'"):
        Parallel(strategy="single")
    monkeypatch.setenv(envmod.PS_SERVERS, "0")
    with pytest.raises(UsageError, match="MANYGPU_PS_SERVERS"):
        envmod.launched_servers(envmod.current())


def test_fp16_is_refused_and_auto_precision_avoids_it() -> None:
    assert "fp16" in get_strategy("ps").refused_precisions  # a skipped step would stall sync
    with pytest.raises(UsageError, match=r"precision='fp16' does not work with strategy 'ps'"):
        Parallel(strategy="ps", precision="fp16", cluster=two_rank_cluster())


# -- the launcher -------------------------------------------------------------------
def test_ps_flag_reaches_the_workers_and_is_checked(tmp_path: Any) -> None:
    from manygpu.launch.agent import worker_env

    script = tmp_path / "train.py"
    script.write_text("")
    spec = resolve(LaunchRequest(entry=str(script), nproc_per_node=3, servers=1), {}, 0)
    assert worker_env(spec)[envmod.PS_SERVERS] == "1"
    assert worker_env(spec)[envmod.EXPENDABLE_FROM] == "1"  # its workers may be lost
    for bad in (0, 3):
        with pytest.raises(UsageError, match=f"--ps {bad}: give 1 to 2 servers"):
            resolve(LaunchRequest(entry=str(script), nproc_per_node=3, servers=bad), {}, 0)


def test_the_keeper_applies_to_workers_only() -> None:
    assert keeper.applies({envmod.EXPENDABLE_FROM: "1", "RANK": "1"})
    assert not keeper.applies({envmod.EXPENDABLE_FROM: "1", "RANK": "0"})
    assert not keeper.applies({envmod.PS_SERVERS: "1", "RANK": "3"})  # the launcher decides
    assert not keeper.applies({"RANK": "3"})


def _status(*, code: int | None = None, sig: int | None = None) -> int:
    """A wait status as os.waitpid returns it."""
    return (code or 0) << 8 if sig is None else sig


def test_the_keeper_passes_exits_on_and_outlives_a_kill(capsys: pytest.CaptureFixture[str]) -> None:
    assert keeper._outcome(_status(code=0), [], 2) == 0
    assert keeper._outcome(_status(code=3), [], 2) == 3  # the script's own failure
    assert keeper._outcome(_status(sig=signal.SIGKILL), [], 2) == 0  # left to the servers
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rank 2 (expendable in this job) was killed by SIGKILL" in err
    assert os.WIFSIGNALED(_status(sig=signal.SIGKILL))


def test_the_progress_bar_shows_the_loss_and_the_servers_progress() -> None:
    from manygpu.core.console import MainConsole
    from manygpu.strategies.ps.client import PSStats

    shown: list[str] = []

    class Bar:
        def update(self, task: object, status: str) -> None:
            shown.append(status)

    console = MainConsole(True, 0)
    console._live = (Bar(), 0)  # type: ignore[assignment]
    console.set_status("loss 0.5")
    stats = PSStats(mode="async", updates=[120, 118], lags=[0, 2, -1])
    console.set_note(stats.line())
    assert shown[-1] == "loss 0.5  ps async: updates 120/118, staleness per worker 0 2 gone"
    assert PSStats(mode="sync", updates=[7]).line() == "ps sync: updates 7"


def test_servers_use_no_gpu_and_workers_take_a_nodes_gpus_from_the_first() -> None:
    from dataclasses import replace

    ps = get_strategy("ps")
    options = PS(servers=2)
    node = replace(two_rank_cluster(), world_size=8, local_world_size=4)
    slots = [
        ps.device_slot(replace(node, rank=r, local_rank=r % 4, node_rank=r // 4), options)
        for r in range(8)
    ]
    assert slots == [None, None, 0, 1, 0, 1, 2, 3]
    ddp = get_strategy("ddp")
    assert abilities.device_slot(ddp, replace(node, rank=5, local_rank=1), DDP()) == 1
