"""The private torch names the rendezvous guard stands on, pinned: a torch upgrade that
moves one fails here, loudly, instead of silently undoing the guard.

- ``DynamicRendezvousHandler._create_tcp_store_server``: our override makes the
  workers' bootstrap store listen on the job's address only (behind the gate); if
  torch stopped calling it, the store would listen on every address again.
- ``StaticTCPRendezvous.next_rendezvous`` reuses ``self._store`` when it is set: ours
  sets it (bound to one address, behind the gate) before calling torch's.
- ``_RendezvousState`` / ``_NodeDesc`` with the fields our JSON state reads and writes
  (``manygpu.launch.rdzv_state``), instead of torch's pickle.

And the agent's process context, which ``manygpu.launch.settle`` reads.
"""

from __future__ import annotations

import dataclasses
import inspect

from torch.distributed.elastic.rendezvous import dynamic_rendezvous, static_tcp_rendezvous

WHERE = "(manygpu.launch.rendezvous relies on it: re-check the guard for this torch)"


def test_torch_still_creates_the_bootstrap_store_through_the_method_we_override() -> None:
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    assert hasattr(handler, "_create_tcp_store_server"), f"torch renamed it {WHERE}"
    callers = inspect.getsource(handler)
    assert "self._create_tcp_store_server(" in callers, f"torch no longer calls it {WHERE}"
    params = list(inspect.signature(handler._create_tcp_store_server).parameters)
    assert params[:3] == ["self", "master_addr", "master_port"], f"its signature moved {WHERE}"


def test_torch_s_static_rendezvous_reuses_a_store_already_set() -> None:
    source = inspect.getsource(static_tcp_rendezvous.StaticTCPRendezvous.next_rendezvous)
    assert "if not self._store" in source, f"static rendezvous no longer reuses _store {WHERE}"


def test_the_rendezvous_state_has_the_fields_our_json_state_carries() -> None:
    state = dynamic_rendezvous._RendezvousState()
    for name in ("round", "complete", "deadline", "closed", "participants", "wait_list",
                 "redundancy_list", "last_heartbeats"):  # fmt: skip
        assert hasattr(state, name), f"_RendezvousState lost {name!r} {WHERE}"
    node = dynamic_rendezvous._NodeDesc("10.0.0.1", 7, 0)
    fields = [f.name for f in dataclasses.fields(node)]
    assert fields == ["addr", "pid", "local_id"], f"_NodeDesc is now {fields} {WHERE}"


def test_the_flight_recorder_keeps_a_destroyed_groups_configuration() -> None:
    """``launch.evidence`` tells a worker that never formed a process group from one
    whose group is gone by reading the recorder's ``pg_config`` (private dump)."""
    import torch.distributed as dist

    from manygpu.launch import evidence

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    dist.destroy_process_group()
    assert evidence.fr_records().get("pg_config"), f"the recorder forgot the group {WHERE}"
    assert evidence._ever_in_group()


def test_fsdp2_s_custom_reduce_scatter_interface_and_default_prefetch_switch() -> None:
    """``strategies/fsdp/host.py`` subclasses FSDP2's private ``ReduceScatter`` and turns
    the default backward prefetch off by naming the unit itself: torch must still take a
    non-empty list as "no default prefetch", and unsharding a gathered unit must be a no-op."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    where = "(manygpu.strategies.fsdp.host relies on it: re-check it for this torch)"
    assert callable(getattr(ReduceScatter, "allocate", None)), f"ReduceScatter moved {where}"
    pre_backward = inspect.getsource(_fsdp_state.FSDPState._pre_backward)
    assert "default_prefetch = len(self._states_to_backward_prefetch) == 0" in pre_backward, where
    unshard = inspect.getsource(_fsdp_param_group.FSDPParamGroup.unshard)
    assert "if self.is_unsharded:\n            return" in unshard, where


def test_the_agent_s_process_context_shows_its_workers_and_error_files() -> None:
    """``launch.settle`` reads the local agent's ``_pcontext`` (its
    ``subprocess_handlers`` and ``error_files``) to let every worker reach a
    configuration error before torch stops them; without them, it waits for nothing."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api

    where = "(manygpu.launch.settle relies on it: re-check it for this torch)"
    assert "self._pcontext" in inspect.getsource(LocalElasticAgent), f"no _pcontext {where}"
    source = inspect.getsource(api.SubprocessContext)
    assert "self.subprocess_handlers = {" in source, f"no subprocess_handlers {where}"
    assert "self.error_files" in inspect.getsource(api.PContext), f"no error_files {where}"


def test_the_agent_s_exit_barrier_is_the_one_a_failed_node_counts_out_of() -> None:
    """``launch.exit_barrier`` counts a failed node into the barrier torch's agent waits in
    after its workers succeed: the same key prefix and node count, and ``_exit_barrier``
    the method the agent calls for it (``launch.agent`` marks it to count only once)."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.utils import store as store_util

    where = "(manygpu.launch.exit_barrier relies on it: re-check it for this torch)"
    assert callable(getattr(store_util, "_barrier_nonblocking", None)), f"no barrier {where}"
    barrier = inspect.getsource(api.SimpleElasticAgent._exit_barrier)
    assert "key_prefix=_TERMINAL_STATE_SYNC_ID" in barrier, where
    assert "world_size=self._worker_group.group_world_size" in barrier, where
    assert "self._exit_barrier()" in inspect.getsource(api.SimpleElasticAgent._invoke_run), where
    assert "self._store" in inspect.getsource(api.SimpleElasticAgent), where
