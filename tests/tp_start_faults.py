"""Start-up faults of one tensor-parallel rank only (spawned ranks import this module).

``RankOneFailsAttach`` is an L3 store for the ``dynamic`` backend whose ``attach``
fails on rank 1 of a group (and works elsewhere), as a store whose path or credentials
only one rank's machine lacks would: with ``unavailable`` the store reads as
unreachable (``StorageUnavailableError``), else as misconfigured (``StorageError``).
``build_rank`` builds one rank's engine in a ``run_ranks`` group, optionally with rank
1's weights failing to load, and reports what it saw. ``follower_failing_before_the_group``
is a follower rank's process target that fails before it joins the group.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

import hicache.engine.build as build_module
import hicache.engine.engine_process as engine_process
from hicache.distributed.group import TPGroup
from hicache.engine.config import EngineConfig
from hicache.memory.allocator import PageIds
from hicache.memory.host_pool import HostPool
from hicache.storage.base import StorageBackend, StorageError, StorageUnavailableError

ATTACH_FAULT = "injected: rank 1 cannot attach its L3 store"
FAILING_RANK = 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class RankOneFailsAttach(StorageBackend):
    """Stores nothing; attach fails on rank ``FAILING_RANK``."""

    name = "rank-one-fails-attach"

    def __init__(self, extra_config: Mapping[str, Any] | None = None) -> None:
        super().__init__(extra_config)
        self.unavailable = bool(self.extra_config.get("unavailable", False))

    def attach(self, host: HostPool) -> None:
        if _rank() == FAILING_RANK:
            error = StorageUnavailableError if self.unavailable else StorageError
            raise error(ATTACH_FAULT)
        super().attach(host)

    def exists(self, keys: Sequence[bytes]) -> int:
        return 0

    def get(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        return 0

    def set(self, keys: Sequence[bytes], host_pages: PageIds) -> int:
        return 0

    def clear(self) -> None:
        pass


def storage_extra(unavailable: bool) -> dict[str, Any]:
    """The ``dynamic`` backend's extra config for ``RankOneFailsAttach``."""
    return {"module_path": __name__, "class_name": "RankOneFailsAttach",
            "unavailable": unavailable}


WEIGHTS_FAULT = "injected: rank 1 cannot read its weights"


@dataclass(frozen=True)
class BuildOutcome:
    """What ``build_rank`` saw on one rank."""

    error: str | None  # the build's error (None: built)
    seconds: float  # how long the build took, failed or not
    l3_attached: bool = False
    l3_error: str | None = None


def build_rank(tp: TPGroup, args: tuple[EngineConfig, bool]) -> BuildOutcome:
    """Build this rank's engine (no scheduler thread); with ``args[1]`` rank 1's weights
    fail to load, before the ranks' first agreement."""
    config, weights_fail = args
    if weights_fail and tp.rank == FAILING_RANK:
        def load_model(*_: Any, **__: Any) -> Any:
            raise OSError(WEIGHTS_FAULT)

        build_module.load_model = load_model  # type: ignore[assignment]
    began = time.monotonic()
    try:
        engine = build_module.build_engine(config, tp, start=False)
    except Exception as error:
        return BuildOutcome(f"{type(error).__name__}: {error}", time.monotonic() - began)
    try:
        cache = engine.cache
        return BuildOutcome(None, time.monotonic() - began, cache.storage is not None,
                            cache.storage_error)
    finally:
        engine.shutdown()


JOIN_FAULT = "injected: rank 1 fails before joining its group"


def follower_failing_before_the_group(
    config: EngineConfig, rank: int, tp_init_method: str, log_level: int,
    start_report: Any = None, parent_pid: int | None = None,
) -> None:
    """``run_follower_process`` whose rank fails before it joins the group (as a model
    file only its machine lacks would): rank 0 then waits in the group's rendezvous."""
    def join(*_: Any) -> Any:
        raise OSError(JOIN_FAULT)

    engine_process._join_group = join  # type: ignore[assignment]
    engine_process.run_follower_process(config, rank, tp_init_method, log_level, start_report,
                                        parent_pid=parent_pid)
