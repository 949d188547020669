"""Prefix sharing for branching rollouts: run the shared first turns of a trajectory once, then
fork the sandbox k ways and run only the differing turns in each copy.

A linear baseline runs every branch from scratch: k·T turns. Branching at turn t costs
t + k·(T − t) turns (plus one fork), so the saving grows with the shared prefix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray

from .handle import SandboxHandle

# turn(sandbox, index, branch): branch is None for the shared prefix, else 0..k-1.
Turn = Callable[[SandboxHandle, int, int | None], Any]


@dataclass
class RolloutTree:
    """Results of a branching rollout and what it cost."""

    prefix: list[Any]
    branches: list[list[Any]]
    turns_executed: int
    linear_turns: int = field(metadata={"doc": "k·T: the same branches run from scratch"})

    @property
    def turns_saved(self) -> int:
        return self.linear_turns - self.turns_executed


def branching_rollout(
    sandbox: SandboxHandle,
    turn: Turn,
    *,
    total_turns: int,
    branch_at: int,
    k: int,
    placement: str = "local",
    keep_branches: bool = False,
) -> RolloutTree:
    """Run turns ``0..branch_at-1`` in ``sandbox``, fork it ``k`` ways and run turns
    ``branch_at..total_turns-1`` in every copy concurrently. The copies are deleted afterwards
    unless ``keep_branches``; ``sandbox`` itself is left at the branch point."""
    if not 0 <= branch_at <= total_turns or k < 1:
        raise ValueError("need 0 <= branch_at <= total_turns and k >= 1")
    executed = 0
    lock = threading.Lock()

    def run(sb: SandboxHandle, i: int, branch: int | None) -> Any:
        nonlocal executed
        with lock:
            executed += 1
        return turn(sb, i, branch)

    prefix = [run(sandbox, i, None) for i in range(branch_at)]
    copies = sandbox.fork(k, placement=placement)
    try:
        with ThreadPoolExecutor(max_workers=k) as pool:
            futures = [
                pool.submit(lambda b, sb: [run(sb, i, b) for i in range(branch_at, total_turns)],
                            b, sb)
                for b, sb in enumerate(copies)
            ]  # fmt: skip
            branches = [f.result() for f in futures]
    finally:
        if not keep_branches:
            ray.get([sb.terminate.remote() for sb in copies])
    return RolloutTree(prefix=prefix, branches=branches, turns_executed=executed,
                       linear_turns=k * total_turns)


__all__ = ["RolloutTree", "Turn", "branching_rollout"]
