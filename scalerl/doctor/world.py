"""How the doctor's ranks find each other without hanging on one that never comes.

`torch.distributed`'s own rendezvous waits for every rank and then fails without saying which one is
missing. Here rank 0 hosts a TCPStore at MASTER_ADDR:MASTER_PORT (under torchrun: the agent's store),
every rank registers its facts, and rank 0 waits up to the join timeout, then publishes the roster: the
ranks that joined and, for each missing one, the host it should have come from. The ranks that joined
form a process group of their own (renumbered through a prefixed store), so the checks still run and the
report names the absentees. Everything crosses as JSON text: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from scalerl.core.rank_env import RankEnv, expand_hostlist, parse_tasks_per_node
from scalerl.parallel.rendezvous import RendezvousError, connect_store

STORE_PREFIX = "scalerl-doctor"
POLL_S = 0.2


@dataclass
class DoctorWorld:
    """The ranks that joined, with every joined rank's facts; collectives over them via ``group``."""

    rank: int  # this process's rank in the launcher's numbering
    world_size: int  # how many ranks the launcher started (or should have)
    joined: list[int]
    facts: list[dict[str, Any]]  # by joined rank, in rank order
    missing: list[dict[str, Any]] = field(default_factory=list)  # {rank, node_rank, expected_host}
    store: Any = None  # None: single process, or a process group that existed before the doctor ran
    join_timeout_s: float = 0.0
    master: str = ""
    _calls: int = 0

    @property
    def size(self) -> int:
        return len(self.joined)

    @property
    def group_rank(self) -> int:
        return self.joined.index(self.rank)

    @property
    def is_main(self) -> bool:
        return self.group_rank == 0

    def all_gather_json(self, name: str, value: Any, timeout_s: float) -> list[Any]:
        """Every joined rank's ``value`` (JSON-able), in rank order, on every rank."""
        if self.size == 1:
            return [value]
        self._calls += 1
        if self.store is None:
            return _gather_json_collective(value)
        key = f"{name}/{self._calls}"
        self.store.set(f"{key}/{self.rank}", json.dumps(value))
        keys = [f"{key}/{r}" for r in self.joined]
        self.store.wait(keys, timedelta(seconds=timeout_s))
        return [json.loads(self.store.get(k)) for k in keys]

    def broadcast_json(self, name: str, value: Any, timeout_s: float) -> Any:
        """Rank 0's ``value`` on every rank."""
        return self.all_gather_json(name, value if self.is_main else None, timeout_s)[0]

    def finish(self, timeout_s: float) -> None:
        """Rank 0 hosts the store: it leaves only once every rank has read what it needs from it."""
        if self.store is None or self.size == 1:
            return
        self.store.add("finished", 1)
        if self.is_main:
            deadline = time.monotonic() + timeout_s
            while self.store.add("finished", 0) < self.size and time.monotonic() < deadline:
                time.sleep(POLL_S)


def _gather_json_collective(value: Any) -> list[Any]:
    """All-gather of JSON text in byte tensors over the default group (no pickle)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    payload = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=device)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device))
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [json.loads(bytes(g[: int(n.item())].cpu().tolist()).decode()) for g, n in zip(gathered, sizes)]


def single_world(facts: dict[str, Any]) -> DoctorWorld:
    return DoctorWorld(0, 1, [0], [facts], master="single process")


def existing_world(facts: dict[str, Any]) -> DoctorWorld:
    """The doctor inside a process group someone else started (every rank of it is there)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    world = DoctorWorld(rank, size, list(range(size)), [], master="existing process group")
    world.facts = world.all_gather_json("facts", facts, timeout_s=300)
    return world


def join_world(env: RankEnv, facts: dict[str, Any], join_timeout_s: float, collective_timeout_s: float,
               backend: str, environ: dict[str, str] | None = None) -> DoctorWorld:
    """Register with the rendezvous, wait for the roster, and start the joined ranks' process group.
    Raises RendezvousError when the rendezvous cannot be reached or this rank joined too late."""
    environ = os.environ if environ is None else environ
    master = f"{env.master_addr}:{env.master_port}"
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)  # torchrun hosts the store itself
    try:
        # a hard deadline (`connect_store`): a handshake once hung 20 minutes in TCPStore's constructor
        store = connect_store(env.master_addr, env.master_port, is_master=env.rank == 0 and not agent_store,
                              timeout_s=join_timeout_s)
    except (RuntimeError, OSError) as e:  # the store's own errors and StoreDeadlineError (a RendezvousError)
        raise RendezvousError(
            f"rank {env.rank}: the rendezvous at {master} (rank 0's host) did not answer within {join_timeout_s:g} s: "
            f"rank 0 has not started, or {env.master_addr} port {env.master_port} is unreachable from here ({e})"
        ) from None
    store = dist.PrefixStore(STORE_PREFIX, store)
    store.set(f"facts/{env.rank}", json.dumps(facts))
    if env.rank == 0:
        roster = _collect_roster(store, env, facts, join_timeout_s, environ)
        store.set("roster", json.dumps(roster))
    else:
        try:
            store.wait(["roster"], timedelta(seconds=join_timeout_s + 30))
        except RuntimeError as e:
            raise RendezvousError(f"rank {env.rank}: no roster from rank 0 at {master} within "
                                  f"{join_timeout_s + 30:g} s ({e})") from None
        roster = json.loads(store.get("roster"))
    if env.rank not in roster["joined"]:
        raise RendezvousError(f"rank {env.rank} registered after rank 0's {join_timeout_s:g} s join timeout and was "
                              "left out of the check; start all ranks together or raise --join-timeout")
    joined = roster["joined"]
    all_facts = [json.loads(store.get(f"facts/{r}")) for r in joined]
    world = DoctorWorld(env.rank, env.world_size, joined, all_facts, roster["missing"], store, join_timeout_s, master)
    if len(joined) > 1:
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=world.group_rank,
                                world_size=len(joined), timeout=timedelta(seconds=collective_timeout_s))
    return world


def _collect_roster(store, env: RankEnv, facts: dict[str, Any], timeout_s: float,
                    environ: dict[str, str]) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    pending = set(range(env.world_size))
    while pending and time.monotonic() < deadline:
        pending = {r for r in pending if not store.check([f"facts/{r}"])}
        if pending:
            time.sleep(POLL_S)
    joined = sorted(set(range(env.world_size)) - pending)
    joined_facts = [json.loads(store.get(f"facts/{r}")) for r in joined]
    missing = [{"rank": r, "node_rank": _node_rank(r, env), "expected_host": expected_host(r, env, joined_facts, environ)}
               for r in sorted(pending)]
    return {"joined": joined, "missing": missing, "world_size": env.world_size, "join_timeout_s": timeout_s,
            "master": f"{env.master_addr}:{env.master_port}"}


def _node_rank(rank: int, env: RankEnv) -> int:
    return rank // env.local_world_size if env.local_world_size else 0


def expected_host(rank: int, env: RankEnv, joined_facts: list[dict[str, Any]], environ: dict[str, str]) -> str:
    """Where ``rank`` should have started: Slurm's node list, else the host of a joined rank on the same
    node (ranks are numbered node by node), else the node's index."""
    hosts = _slurm_hosts(environ)
    if hosts is not None and rank < len(hosts):
        return hosts[rank]
    node = _node_rank(rank, env)
    peers = [f for f in joined_facts if f.get("node_rank") == node]
    if peers:
        address = (peers[0].get("socket") or {}).get("address")
        return f"{peers[0]['hostname']}" + (f" ({address})" if address else "") + \
            f", node {node} (its ranks {', '.join(str(f['rank']) for f in peers)} joined from there)"
    return f"node {node} (no rank of that node joined; launcher host list unknown)"


def _slurm_hosts(environ: dict[str, str]) -> list[str] | None:
    """Host of every rank from Slurm's node list and tasks per node (block distribution)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    tasks = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not tasks:
        return None
    try:
        hosts, counts = expand_hostlist(nodelist), parse_tasks_per_node(tasks)
    except ValueError:
        return None
    return [host for host, count in zip(hosts, counts) for _ in range(count)]
