"""Through ``hicache router``: a client that leaves while its request waits in a real worker's
queue drops it there (the router closes its connection to the worker, the worker aborts the
request before its next step): the abandoned prompts cost the worker no prefill at all."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from tests.abandoned_clients import held_request, leave, long_prompt, sample, scrape
from tests.router_fixtures import running_router
from tests.server_fixtures import long_stream, serve_in_thread

HOLDERS = 2
ABANDONED = 8
PROMPT_TOKENS = 1500
DEADLINE_S = 60.0  # bounds a failing test only: every wait is for an event


def _body(index: int) -> tuple[str, dict[str, Any]]:
    ids = long_prompt(index, PROMPT_TOKENS)
    if index % 2:
        return "/v1/completions", {"prompt": ids, "max_tokens": 4, "stream": index % 4 == 1}
    return "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4},
                         "stream": index % 4 == 0}


def test_clients_that_leave_through_the_router_cost_the_worker_no_prefill() -> None:
    args = ["--max-running-requests", str(HOLDERS), "--max-total-tokens", "20000"]
    with serve_in_thread(args) as worker, running_router([worker.url]) as router:
        engine = worker.engine
        with ExitStack() as holders:
            for _ in range(HOLDERS):
                holders.enter_context(long_stream(worker))
            before = scrape(worker.url)
            sockets = [held_request(router.url, *_body(i)) for i in range(ABANDONED)]
            assert worker.wait_until(
                lambda: engine.metrics()["engine_waiting_requests"] == ABANDONED, DEADLINE_S
            ), engine.metrics()
            for sock in sockets:
                leave(sock)
            assert worker.wait_until(
                lambda: engine.metrics()["engine_num_aborted_waiting"]
                == sample(before, "hicache_requests_aborted_by_phase_total", phase="waiting")
                + ABANDONED, DEADLINE_S,
            ), engine.metrics()
            after = scrape(worker.url)
            assert engine.metrics()["engine_running_requests"] == HOLDERS  # held all along
        assert after["hicache_prefill_step_tokens_total"] == \
            before["hicache_prefill_step_tokens_total"]
        routed = scrape(router.url)
        assert sample(routed, "router_client_disconnects_total",
                      stage="before_answer") == ABANDONED
        assert worker.wait_idle(DEADLINE_S)
        engine.check_integrity()
