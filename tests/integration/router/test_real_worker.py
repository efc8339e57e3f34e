"""The router in front of a real ``hicache serve`` app (tiny engine on CPU): discovered
from its /get_server_info, and hashing exactly the prompt tokens the worker counts."""

from __future__ import annotations

import json

import httpx

from tests.router_fixtures import running_router
from tests.server_fixtures import serve_in_thread


def test_a_real_worker_is_discovered_and_its_prompts_hashed_as_it_counts_them() -> None:
    with serve_in_thread() as worker, running_router([worker.url]) as router:
        info = router.get("/get_server_info").json()
        assert info["page_size"] == 16
        messages = [{"role": "user", "content": "tell me about page tables " * 3}]
        response = router.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 2, "temperature": 0})
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert router.policy.requests[-1].prompt_tokens == usage["prompt_tokens"]
        assert len(router.policy.requests[-1].page_hashes) == usage["prompt_tokens"] // 16

        body = {"text": "a prompt of some length " * 4, "stream": True,
                "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        with httpx.stream("POST", f"{router.url}/generate", json=body, timeout=30) as streamed:
            assert streamed.status_code == 200
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        assert router.policy.requests[-1].prompt_tokens == last["meta_info"]["prompt_tokens"]
        assert worker.wait_idle()
