"""The prefill instance's side of disaggregation, on the scheduler thread.

A request with a bootstrap room runs as any other (its cached prefix reused from
L1/L2/L3) but stops at its first token. Instead of finishing then, it is handed
off: out of the running batch, its pages still held, the sender's thread writes
the prompt's KV into the decode instance's pool. When the sender reports back
(``on_sent``, run between steps), the request finishes as usual: its KV goes to
the radix tree and its answer (the first token) to the client, or, if the
transfer failed, it finishes aborted with the transfer's error.

It sees the scheduler through ``HandoffHost`` (the request lifecycle): take a
request out of the batch with its pages held, and end a request held so.
"""

from __future__ import annotations

import logging
from typing import Protocol

from hicache.disaggregation.kv_sender import KVSender, SendJob
from hicache.engine.logprobs import handoff_logprobs
from hicache.engine.request import Req

logger = logging.getLogger(__name__)


class HandoffHost(Protocol):
    """What the handoff does to the scheduler's requests (``RequestLifecycle``)."""

    @property
    def page_size(self) -> int: ...

    def detach(self, req: Req) -> None:
        """Out of the batch and its page-table row, its pages held."""

    def finish_held(
        self, req: Req, reason: str, error: str | None = None, flush_text: bool = True
    ) -> None:
        """End a detached request as any (its KV to the tree, its answer to the client)."""


class PrefillHandoff:
    def __init__(self, host: HandoffHost, sender: KVSender) -> None:
        self.host = host
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
        page_size = self.host.page_size
        prompt_pages = req.pages[: -(-req.prompt_len // page_size)].copy()
        # Out of the batch (and its page-table row), its pages held until on_sent.
        self.host.detach(req)
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
        if error is None:
            self.host.finish_held(req, reason)
        else:
            self.host.finish_held(req, "abort", error=error, flush_text=False)

    def fail_all(self, message: str) -> None:
        """Shutting down: finish every request being sent as failed."""
        for rid in list(self.sending):
            self.on_sent(rid, message)
