"""Sets an engine up as one side of prefill-decode disaggregation (``hicache.disaggregation``).

A prefill instance runs the bootstrap server and a KV sender; a decode instance a KV
receiver. Both run a Mooncake TransferEngine over their device pool. Their threads
report to the scheduler through ``Scheduler.call`` (run between steps), so the
scheduler thread itself never waits on the network.
"""

from __future__ import annotations

import logging
from typing import Any

from hicache.disaggregation.bootstrap_server import BootstrapServer
from hicache.disaggregation.config import DisaggregationConfig, DisaggregationMode
from hicache.disaggregation.kv_receiver import KVReceiver
from hicache.disaggregation.kv_sender import KVSender
from hicache.disaggregation.pool_descriptor import PoolDescriptor
from hicache.disaggregation.rooms import RoomTable
from hicache.disaggregation.transfer_engine import KVTransferEngine
from hicache.engine.pd_decode import DecodeIntake
from hicache.engine.pd_prefill import PrefillHandoff
from hicache.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class DisaggregationRuntime:
    """What one side runs beside the scheduler; ``close`` stops it (after the scheduler)."""

    def __init__(self, config: DisaggregationConfig, scheduler: Scheduler) -> None:
        self.config = config
        pool = scheduler.cache.device_pool
        self.engine = KVTransferEngine(pool, config.host)
        descriptor = PoolDescriptor.of(pool)
        self.server: BootstrapServer | None = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        timeout_s = config.transfer_timeout_s
        if config.mode is DisaggregationMode.PREFILL:
            rooms = RoomTable(stale_after_s=4 * timeout_s)

            def on_sent(rid: str, error: str | None) -> None:
                handoff = scheduler.lifecycle.prefill_handoff
                assert handoff is not None
                scheduler.call(lambda: handoff.on_sent(rid, error))

            # A job holds its thread while it waits for the decode side to register.
            self.sender = KVSender(
                self.engine, descriptor, rooms, timeout_s, on_sent,
                max_workers=max(8, scheduler.limits.max_running_requests),
            )
            scheduler.lifecycle.prefill_handoff = PrefillHandoff(scheduler.lifecycle, self.sender)
            try:
                self.server = BootstrapServer(rooms, config.host, config.bootstrap_port).start()
            except OSError as error:
                self.close()
                raise OSError(
                    f"the bootstrap server cannot listen on port {config.bootstrap_port}: "
                    f"{error} (pick another with --disaggregation-bootstrap-port)"
                ) from error
        elif config.mode is DisaggregationMode.DECODE:
            def on_received(
                rid: str, token: int | None, logprobs: dict[str, Any] | None,
                error: str | None,
            ) -> None:
                intake = scheduler.decode_intake
                assert intake is not None
                scheduler.call(lambda: intake.on_received(rid, token, logprobs, error))

            self.receiver = KVReceiver(
                self.engine.session_id, descriptor, timeout_s, on_received,
                max_workers=max(4, scheduler.limits.max_running_requests),
            )
            scheduler.decode_intake = DecodeIntake(
                scheduler.lifecycle, self.receiver, config.decode_offload_kvcache,
                scheduler.model.config.vocab_size,
            )
        logger.info("disaggregation: %s instance, KV transfer engine at %s",
                    config.mode.value, self.engine.session_id)

    def info(self) -> dict[str, Any]:
        return {
            "disaggregation_mode": self.config.mode.value,
            "disaggregation_bootstrap_port": self.server.port if self.server else None,
            "disaggregation_transfer_session": self.engine.session_id,
        }

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        self.engine.close()
