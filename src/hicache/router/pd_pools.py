"""The two pools of a prefill-decode disaggregated router, and how a decode instance is chosen.

Prefill instances are a :class:`WorkerRegistry` over the router's index: their
KV events feed it and the cache-aware policy picks among them, as among
ordinary workers. Decode instances are a second registry over a
:class:`NullIndex`: a decode instance's prefix cache does not spare any
prefill (the KV always comes from the prefill instance), so only its load
counts. Both registries probe /health and take a dead instance out of rotation
the same way.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from hicache.events.messages import KVEventBatch
from hicache.router.settings import DecodePolicyName, PrefillEndpoint
from hicache.router.types import TierOverlap
from hicache.router.workers import Worker, WorkerRegistry


class DisaggregationMode(str, enum.Enum):
    """What an instance reports as ``disaggregation_mode`` in /get_server_info."""

    PREFILL = "prefill"
    DECODE = "decode"
    NULL = "null"  # an ordinary instance


class NullIndex:
    """A TierIndex that keeps nothing: the decode pool's (its prefixes do not matter)."""

    def apply(self, worker: str, batch: KVEventBatch) -> None:
        pass

    def clear_worker(self, worker: str) -> None:
        pass

    def remove_worker(self, worker: str) -> None:
        pass

    def overlaps(self, page_hashes: Sequence[int], workers: Sequence[str],
                 ) -> dict[str, TierOverlap]:
        return {worker: TierOverlap() for worker in workers}

    def num_pages(self) -> int:
        return 0


class RoundRobinDecode:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, workers: Sequence[Worker]) -> Worker:
        worker = workers[self._turn % len(workers)]
        self._turn += 1
        return worker


class LeastLoadDecode:
    """Fewest requests in flight, then fewest prompt pages, then registration order."""

    def choose(self, workers: Sequence[Worker]) -> Worker:
        return min(workers, key=lambda w: (w.active_requests, w.active_prompt_pages))


DecodeChooser = RoundRobinDecode | LeastLoadDecode
_DECODE_CHOOSERS: dict[DecodePolicyName, type[RoundRobinDecode] | type[LeastLoadDecode]] = {
    DecodePolicyName.ROUND_ROBIN: RoundRobinDecode,
    DecodePolicyName.LEAST_LOAD: LeastLoadDecode,
}


def create_decode_chooser(name: DecodePolicyName) -> DecodeChooser:
    return _DECODE_CHOOSERS[name]()


@dataclass
class PDPools:
    prefill: WorkerRegistry
    decode: WorkerRegistry
    # Prefill url -> its bootstrap server's port (``--prefill URL PORT``).
    bootstrap_ports: dict[str, int]

    @classmethod
    def bootstrap_map(cls, endpoints: Sequence[PrefillEndpoint]) -> dict[str, int]:
        return {e.url: e.bootstrap_port for e in endpoints}

    def start(self) -> None:
        self.prefill.start()
        self.decode.start()

    async def stop(self) -> None:
        await self.prefill.stop()
        await self.decode.stop()

    def all(self) -> list[Worker]:
        return [*self.prefill.all(), *self.decode.all()]
