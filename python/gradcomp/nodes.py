"""Which ranks share a node, and the process groups of the hierarchical scheme.

A node holds L ranks numbered together (ranks n*L .. n*L + L-1 on node n), as torchrun numbers them. L comes from
the option node_size= where it is given (which also serves emulation: several "nodes" on one machine), else from
torchrun's LOCAL_WORLD_SIZE where every rank has it, else from the ranks' host names. Every rank gathers the same
facts (gradcomp's configuration check carries them), so every rank finds the same layout and creates the same
groups, once: one inside each node, and one across the nodes for each local rank.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


def facts() -> dict[str, Any]:
    """What this rank knows of its node, for every rank to gather."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return {"host": socket.gethostname(), "local_world_size": int(local) if local and local.isdigit() else None}


def group_timeout(group):
    """The timeout a process group was created with, or None (the default) where the backend does not say."""
    try:
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def check_node_size(node_size) -> int | None:
    if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1):
        raise ValueError(f"gradcomp: node_size={node_size!r} must be an integer >= 1 (the ranks per node), or None to "
                         f"find it from torchrun's LOCAL_WORLD_SIZE or the ranks' host names")
    return node_size


def find_node_size(world: int, option: int | None, gathered: list[dict[str, Any]]) -> tuple[int | None, str]:
    """(ranks per node, how it was found), or (None, why there is no layout of equal nodes). A node_size that does
    not divide the world size is a ValueError."""
    if option is not None:
        if world % option:
            raise ValueError(f"gradcomp: node_size={option} does not divide the world size {world}: every node must "
                             f"hold node_size ranks")
        return option, f"node_size={option}"
    sizes = {fact["local_world_size"] for fact in gathered}
    if None not in sizes:
        if len(sizes) > 1:
            return None, f"the nodes hold unequal numbers of ranks (LOCAL_WORLD_SIZE {sorted(sizes)})"
        size = sizes.pop()
        if world % size:
            return None, f"LOCAL_WORLD_SIZE={size} does not divide the world size {world}"
        return size, f"LOCAL_WORLD_SIZE={size}"
    hosts = [fact["host"] for fact in gathered]
    runs = [hosts[0]]  # the hosts in rank order, each run of equal names once
    for host in hosts[1:]:
        if host != runs[-1]:
            runs.append(host)
    if len(runs) != len(set(runs)):
        return None, "the ranks of a host are not numbered together"
    counts = {hosts.count(host) for host in runs}
    if len(counts) > 1:
        return None, f"the hosts hold unequal numbers of ranks ({sorted(counts)})"
    return counts.pop(), f"{len(runs)} host names"


@dataclass
class NodeLayout:
    """N nodes of L ranks: this rank's node and local rank, and the groups inside its node and across the nodes."""

    world: int
    node_size: int
    rank: int
    found_by: str
    inside: Any = field(default=None, repr=False)   # the process group of this rank's node
    across: Any = field(default=None, repr=False)   # the ranks of this local rank, one per node

    @property
    def nodes(self) -> int:
        return self.world // self.node_size

    @property
    def node(self) -> int:
        return self.rank // self.node_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.node_size

    @property
    def two_levels(self) -> bool:
        """Whether there is more than one node and more than one rank per node: only then do levels differ."""
        return self.nodes > 1 and self.node_size > 1

    def create_groups(self, like) -> None:
        """Every rank calls this at the same point, and creates every group in the same order, with the timeout of
        the group `like` (DDP's): a rank that dies or stalls ends the others' step within it, as there."""
        size, nodes, timeout = self.node_size, self.nodes, group_timeout(like)
        for node in range(nodes):
            group = dist.new_group(list(range(node * size, (node + 1) * size)), timeout=timeout)
            if node == self.node:
                self.inside = group
        for local in range(size):
            group = dist.new_group(list(range(local, self.world, size)), timeout=timeout)
            if local == self.local_rank:
                self.across = group

    def describe(self) -> str:
        return f"{self.nodes} nodes of {self.node_size} ranks ({self.found_by})"
