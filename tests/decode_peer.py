"""A decode side in a process of its own, for the transfer layer's two-process tests.

``decode_peer_main`` builds a device pool (zeros) with its own transfer engine and
receiver, allocates pages for a room and waits for the KV; it puts on ``results``
the first token and the logprobs sent with it (or the error) and the received pages'
KV, then exits.
"""

from __future__ import annotations

import logging
from multiprocessing.queues import Queue
from typing import Any

import numpy as np
import torch

from hicache.disaggregation.kv_receiver import KVReceiver, ReceiveJob
from hicache.disaggregation.pool_descriptor import PoolDescriptor
from hicache.disaggregation.transfer_engine import KVTransferEngine
from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import KVGeometry

GEOMETRY = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
PAGE_SIZE = 4
NUM_PAGES = 32


def make_pool() -> DevicePool:
    return DevicePool(GEOMETRY, NUM_PAGES, PAGE_SIZE)


def decode_peer_main(
    port: int, room: int, pages: list[int], timeout_s: float, results: Queue[Any],
) -> None:
    logging.basicConfig(level=logging.WARNING)
    pool = make_pool()
    engine = KVTransferEngine(pool, "127.0.0.1")
    done: Queue[Any] = results

    def on_done(
        rid: str, token: int | None, logprobs: dict[str, Any] | None, error: str | None
    ) -> None:
        page_ids = torch.tensor(pages)
        # As numpy: a torch tensor crosses a queue in shared memory that dies with us.
        done.put((token, logprobs, error,
                  pool.pages[page_ids].view(torch.int16).numpy().copy()))

    receiver = KVReceiver(engine.session_id, PoolDescriptor.of(pool), timeout_s, on_done)
    receiver.receive(ReceiveJob("r", "127.0.0.1", port, room, np.asarray(pages, np.int64)))
    receiver.close()
    engine.close()
