"""Requests a router sends to every worker (``/flush_cache``, ``/abort_request``): one
answer that lists each worker's, failing with the first failure's status. Workers are
named by their URLs without credentials (``credentials.redact``)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from hicache.router.credentials import redact


def fan_out_answer(results: dict[str, tuple[int, Any]], done: str) -> JSONResponse:
    """``{done: every worker answered 200, "workers": {url: {status, response}}}``."""
    failed = [status for status, _ in results.values() if status != 200]
    body = {done: not failed,
            "workers": {redact(url): {"status": status, "response": answer}
                        for url, (status, answer) in results.items()}}
    return JSONResponse(body, status_code=failed[0] if failed else 200)
