"""The prefill instance's side of disaggregation, on the scheduler thread.

A request with a bootstrap room runs as any other (its cached prefix reused from
L1/L2/L3) but stops at its first token. Instead of finishing then, it is handed
off: out of the running batch, its pages still held, the sender's thread writes
the prompt's KV into the decode instance's pool. When the sender reports back
(``on_sent``, run between steps), the request finishes as usual: its KV goes to
the radix tree and its answer (the first token) to the client, or, if the
transfer failed, it finishes aborted with the transfer's error.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hicache.disaggregation.kv_sender import KVSender, SendJob
from hicache.engine.logprobs import handoff_logprobs
from hicache.engine.request import Req

if TYPE_CHECKING:
    from hicache.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class PrefillHandoff:
    def __init__(self, scheduler: Scheduler, sender: KVSender) -> None:
        self.scheduler = scheduler
        self.sender = sender
        # Requests whose KV is on its way: rid -> (request, the reason it finished).
        self.sending: dict[str, tuple[Req, str]] = {}

    @property
    def num_sending(self) -> int:
        return len(self.sending)

    def length_limit(self, req: Req) -> int:
        """The decode instance generates: here a request ends at its first token."""
        return min(req.length_limit, req.prompt_len + 1)

    def intercept_finish(self, req: Req, reason: str, error: str | None) -> bool:
        """Called as ``req`` finishes; True when it is handed off (or already is) instead."""
        if req.rid in self.sending:
            return True  # an abort while its KV is sent: the transfer ends it
        bootstrap = req.request.bootstrap
        if bootstrap is None or req.kv_handed_off:
            return False
        if reason == "abort" or len(req.output_ids) != 1 or req.num_computed < req.prompt_len:
            # It ends with no KV to send (aborted, failed, or no token asked for): the
            # decode side learns it now rather than at its timeout.
            why = f"{reason}: {error}" if error else reason
            self.sender.rooms.finish(
                bootstrap.room, None, f"the prefill instance ended the request without "
                f"sending its KV ({why})",
            )
            return False
        scheduler = self.scheduler
        page_size = scheduler.page_size
        prompt_pages = req.pages[: -(-req.prompt_len // page_size)].copy()
        # Out of the batch (and its page-table row), its pages held until on_sent.
        scheduler.running.remove(req)
        scheduler.runner.release(req)
        self.sending[req.rid] = (req, reason)
        logprobs = None
        if req.request.logprobs is not None:  # the decode instance answers with them
            logprobs = handoff_logprobs(req.input_logprobs, req.output_logprobs[0])
        self.sender.send(
            SendJob(req.rid, bootstrap.room, prompt_pages, req.output_ids[0], logprobs)
        )
        return True

    def on_sent(self, rid: str, error: str | None) -> None:
        """The sender's report, on the scheduler thread: finish the request."""
        entry = self.sending.pop(rid, None)
        if entry is None:
            logger.error("a KV transfer ended for request %s, which is not being sent", rid)
            return
        req, reason = entry
        req.kv_handed_off = True
        scheduler = self.scheduler
        scheduler.running.append(req)  # _finish takes it out of the batch
        if error is None:
            scheduler._finish(req, reason)
        else:
            scheduler._finish(req, "abort", error=error, flush_text=False)

    def fail_all(self, message: str) -> None:
        """Shutting down: finish every request being sent as failed."""
        for rid in list(self.sending):
            self.on_sent(rid, message)
