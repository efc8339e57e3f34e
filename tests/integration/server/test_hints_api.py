"""POST /hicache/hints and the ``hicache_hints`` field of /generate, /v1/completions and
/v1/chat/completions (``server/hints.py``, ``server/hint_protocol.py``), against a
stand-in engine behind the real app and uvicorn: valid bodies reach the engine as
``Hint``s and its outcomes come back as they are; a malformed item is a 400 naming
``hints[i]`` with nothing applied; the route is open as /generate is (the admin key is
not asked for); a draining worker answers 409. /metrics names the hint series (tenants
bounded) and the warm's counters."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from hicache.engine.api import (
    CachedTokens,
    GenerateOutput,
    GenerateRequest,
    Hint,
    HintKind,
    HintOutcome,
    HintOutcomeKind,
    RequestError,
)
from hicache.server.app import create_app
from hicache.server.hint_metrics import MAX_TENANT_SERIES
from hicache.server.hint_protocol import MAX_ITEMS
from hicache.tokenizer.byte_level import ByteTokenizer
from tests.server_fixtures import serve_app_in_thread

ADMIN = "hints-admin-key"
VOCAB = 256
CONTEXT = 64


def outcome_of(index: int, hint: Hint) -> HintOutcome:
    """The stand-in's answer: a prefix of 3 tokens or fewer is unknown (rejected), a
    longer one is covered but for its last token (clipped), an unpin is accepted."""
    tokens = len(hint.input_ids or (1, 2, 3, 4))
    if hint.kind is HintKind.UNPIN:
        return HintOutcome(index, hint.kind, HintOutcomeKind.ACCEPTED, tokens)
    if tokens <= 3:
        return HintOutcome(index, hint.kind, HintOutcomeKind.REJECTED,
                           reason="unknown prefix: nothing cached")
    return HintOutcome(index, hint.kind, HintOutcomeKind.CLIPPED, tokens - 1, 1,
                       reason="the last page is partial")


class HintingEngine:
    """Streams two tokens per request; applies hints by recording them."""

    model_name = "hinting"
    vocab_size = VOCAB
    max_context_len = CONTEXT
    tokenizer = ByteTokenizer()

    def __init__(self) -> None:
        self.applied: list[list[Hint]] = []
        self.requests: list[GenerateRequest] = []
        self.status: dict[str, Any] = {
            "pinned_pages": 7, "pinned_pages_by_tenant": {"acme": 5, "zeta": 2},
            "retained_pages": 3, "pin_budget_pages": 64, "tenant_pin_budget_pages": 32,
            "records": 4, "outcomes": {"pin/accepted": 2, "retain/clipped": 1},
        }

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokenize("".join(str(m.get("content", "")) for m in messages))

    def apply_hints(self, hints: list[Hint]) -> list[HintOutcome]:
        self.applied.append(list(hints))
        return [outcome_of(i, hint) for i, hint in enumerate(hints)]

    def hint_status(self) -> dict[str, Any]:
        return self.status

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        if not request.input_ids:
            raise RequestError("the prompt is empty")
        self.requests.append(request)
        n = len(request.input_ids)
        yield GenerateOutput(request.rid, (65,), "A", False, None, n, 1, CachedTokens())
        outcomes = None
        if request.hints:
            outcomes = [outcome_of(i, h) for i, h in enumerate(request.hints)]
        yield GenerateOutput(request.rid, (66,), "B", True, "length", n, 2, CachedTokens(),
                             ttft_s=0.0, latency_s=0.0, hints=outcomes)

    def abort(self, rid: str) -> None:
        pass

    def flush_cache(self) -> bool:
        return True

    def is_idle(self) -> bool:
        return True

    def abort_all(self, message: str) -> int:
        return 0

    def metrics(self) -> dict[str, float]:
        return {}

    def attach_storage(self, backend: str, extra_config: dict[str, Any], policy: str) -> None:
        pass

    def detach_storage(self) -> None:
        pass

    def storage_status(self) -> dict[str, Any]:
        return {"attached": False, "error": None}


@pytest.fixture(scope="module")
def engine() -> HintingEngine:
    return HintingEngine()


@pytest.fixture(scope="module")
def client(engine: HintingEngine) -> Iterator[httpx.Client]:
    app = create_app(engine, admin_api_key=ADMIN)
    with serve_app_in_thread(app) as url, httpx.Client(base_url=url, timeout=30.0) as http:
        yield http


def post_hints(client: httpx.Client, hints: Any) -> httpx.Response:
    return client.post("/hicache/hints", json={"hints": hints})


def test_hints_reach_the_engine_and_their_outcomes_come_back_in_order(
    client: httpx.Client, engine: HintingEngine,
) -> None:
    before = len(engine.applied)
    response = post_hints(client, [
        {"kind": "pin", "input_ids": [1, 2, 3, 4, 5], "ttl_s": 60, "tier": "l3",
         "tenant": "acme", "cache_salt": "s1"},
        {"kind": "retain", "text": "hello", "ttl_s": 30.5},
        {"kind": "demote", "input_ids": [9, 9]},
        {"kind": "unpin", "input_ids": [1, 2, 3, 4, 5], "tenant": "acme"},
        {"kind": "prefetch", "text": "abcdef"},
    ])
    assert response.status_code == 200, response.text
    assert len(engine.applied) == before + 1
    pin, retain, demote, unpin, prefetch = engine.applied[-1]
    assert pin == Hint(HintKind.PIN, (1, 2, 3, 4, 5), 60.0, "l3", "acme", "s1")
    # Texts are tokenized as /generate tokenizes a prompt; defaults fill the rest.
    assert retain == Hint(HintKind.RETAIN, tuple(b"hello"), 30.5, "host", "default", None)
    assert demote.kind is HintKind.DEMOTE and demote.ttl_s is None
    assert unpin.tenant == "acme" and prefetch.input_ids == tuple(b"abcdef")
    results = response.json()["results"]
    assert results == [outcome_of(i, h).as_dict() for i, h in enumerate(engine.applied[-1])]
    assert results[0] == {"index": 0, "kind": "pin", "outcome": "clipped", "tokens": 4,
                          "clipped_tokens": 1, "reason": "the last page is partial"}
    assert results[2]["outcome"] == "rejected" and "unknown prefix" in results[2]["reason"]


BAD_ITEMS = [
    ({"kind": "evict", "input_ids": [1]}, "kind"),
    ({"kind": "pin"}, "exactly one of input_ids"),
    ({"kind": "pin", "input_ids": [1], "text": "a"}, "exactly one of input_ids"),
    ({"kind": "pin", "input_ids": []}, "empty"),
    ({"kind": "pin", "text": ""}, "empty"),
    ({"kind": "pin", "input_ids": [1, VOCAB]}, "out of the vocabulary"),
    ({"kind": "pin", "input_ids": [-1]}, "out of the vocabulary"),
    ({"kind": "pin", "input_ids": [1] * (CONTEXT + 1)}, "longer than the context"),
    ({"kind": "pin", "text": "x" * (CONTEXT + 1)}, "longer than the context"),
    ({"kind": "pin", "input_ids": [1], "ttl_s": 0}, "ttl_s"),
    ({"kind": "pin", "input_ids": [1], "ttl_s": -5}, "ttl_s"),
    ({"kind": "pin", "input_ids": [1], "ttl_s": "soon"}, "ttl_s"),
    ({"kind": "prefetch", "input_ids": [1], "ttl_s": 10}, "ttl_s applies to pin and retain"),
    ({"kind": "retain", "input_ids": [1], "tier": "l3"}, "tier applies to pin only"),
    ({"kind": "pin", "input_ids": [1], "tier": "disk"}, "tier"),
    ({"kind": "pin", "input_ids": [1], "tenant": "a b"}, "tenant"),
    ({"kind": "pin", "input_ids": [1], "tenant": "t" * 65}, "tenant"),
    ({"kind": "pin", "input_ids": [1], "tenant": ""}, "tenant"),
    ({"kind": "pin", "input_ids": [1], "pages": 3}, "pages"),
    ({"kind": "pin", "input_ids": [1.5]}, "input_ids"),
    ("pin", "hints"),
]


@pytest.mark.parametrize(("item", "expected"), BAD_ITEMS)
def test_a_malformed_item_is_a_400_naming_it_and_nothing_is_applied(
    client: httpx.Client, engine: HintingEngine, item: Any, expected: str,
) -> None:
    before = len(engine.applied)
    good = {"kind": "pin", "input_ids": [1, 2, 3, 4]}
    response = post_hints(client, [good, good, item])
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert expected in message
    if item != "pin":  # a non-object fails the body's own check
        assert message.startswith("hints[2]: "), message
    assert len(engine.applied) == before


@pytest.mark.parametrize(("body", "expected"), [
    ({"hints": []}, "hints is empty"),
    ({"hints": [{"kind": "pin", "input_ids": [1]}] * (MAX_ITEMS + 1)}, f"at most {MAX_ITEMS}"),
    ({}, "hints"),
    ({"hints": [], "extra": 1}, "extra"),
    ([{"kind": "pin", "input_ids": [1]}], "object"),
])
def test_a_malformed_body_is_a_400(
    client: httpx.Client, engine: HintingEngine, body: Any, expected: str,
) -> None:
    before = len(engine.applied)
    response = client.post("/hicache/hints", json=body)
    assert response.status_code == 400, response.text
    assert expected in response.json()["error"]["message"]
    assert len(engine.applied) == before


def test_the_route_needs_no_admin_key(client: httpx.Client) -> None:
    """Open as /generate is: a server with an admin key does not ask for it here, and a
    wrong one changes nothing."""
    hints = [{"kind": "retain", "input_ids": [1, 2, 3, 4]}]
    assert post_hints(client, hints).status_code == 200
    wrong = client.post("/hicache/hints", json={"hints": hints},
                        headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 200


def test_a_draining_worker_answers_409_and_applies_nothing() -> None:
    engine = HintingEngine()
    app = create_app(engine, admin_api_key=ADMIN)
    with serve_app_in_thread(app) as url, httpx.Client(base_url=url, timeout=30.0) as http:
        drain = http.post("/hicache/drain", headers={"Authorization": f"Bearer {ADMIN}"})
        assert drain.status_code == 202, drain.text
        response = post_hints(http, [{"kind": "pin", "input_ids": [1, 2, 3, 4]}])
        assert response.status_code == 409
        assert "draining" in response.json()["error"]["message"]
        # A bad body is still a 400: the body is judged first.
        assert post_hints(http, [{"kind": "pin"}]).status_code == 400
    assert engine.applied == []


# ----------------------------------------------------------- hicache_hints on bodies
OWN_HINTS = [{"kind": "pin", "ttl_s": 120, "tier": "host", "tenant": "acme"},
             {"kind": "retain"}]


def expected_own(extra_key: str | None) -> tuple[Hint, ...]:
    return (Hint(HintKind.PIN, None, 120.0, "host", "acme", extra_key),
            Hint(HintKind.RETAIN, None, None, "host", "default", extra_key))


def own_outcomes() -> list[dict[str, Any]]:
    return [outcome_of(i, h).as_dict() for i, h in enumerate(expected_own(None))]


def test_generate_takes_hints_and_answers_their_outcomes_in_meta_info(
    client: httpx.Client, engine: HintingEngine,
) -> None:
    response = client.post("/generate", json={"text": "hello", "cache_salt": "s",
                                               "hicache_hints": OWN_HINTS})
    assert response.status_code == 200, response.text
    assert engine.requests[-1].hints == expected_own("s")
    assert response.json()["meta_info"]["hints"] == own_outcomes()
    plain = client.post("/generate", json={"text": "hello"})
    assert "hints" not in plain.json()["meta_info"] and engine.requests[-1].hints == ()


def test_a_generate_batch_gives_the_hints_to_each_prompt(
    client: httpx.Client, engine: HintingEngine,
) -> None:
    response = client.post("/generate", json={"text": ["hello", "world"],
                                               "hicache_hints": OWN_HINTS})
    assert response.status_code == 200, response.text
    assert [r.hints for r in engine.requests[-2:]] == [expected_own(None)] * 2
    assert [r["meta_info"]["hints"] for r in response.json()] == [own_outcomes()] * 2


def test_generate_streams_the_outcomes_in_its_last_chunk(
    client: httpx.Client, engine: HintingEngine,
) -> None:
    with client.stream("POST", "/generate", json={
        "input_ids": [5, 6, 7], "stream": True, "hicache_hints": OWN_HINTS,
    }) as response:
        chunks = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                  if line and line != "data: [DONE]"]
    assert "hints" not in chunks[0]["meta_info"]
    assert chunks[-1]["meta_info"]["hints"] == own_outcomes()


def test_completions_take_hints_and_answer_them_at_the_top_level(
    client: httpx.Client, engine: HintingEngine,
) -> None:
    response = client.post("/v1/completions", json={
        "prompt": "hello", "max_tokens": 2, "extra_key": "k", "hicache_hints": OWN_HINTS,
    })
    assert response.status_code == 200, response.text
    assert engine.requests[-1].hints == expected_own("k")
    assert response.json()["hicache_hints"] == own_outcomes()
    plain = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert "hicache_hints" not in plain.json()


def test_n_samples_carry_the_hints_once(client: httpx.Client, engine: HintingEngine) -> None:
    response = client.post("/v1/completions", json={
        "prompt": "hello", "max_tokens": 2, "n": 3, "hicache_hints": OWN_HINTS,
    })
    assert response.status_code == 200, response.text
    assert [bool(r.hints) for r in engine.requests[-3:]] == [True, False, False]
    assert response.json()["hicache_hints"] == own_outcomes()


def test_chat_takes_hints_whole_and_streamed(
    client: httpx.Client, engine: HintingEngine,
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "hicache_hints": OWN_HINTS}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert engine.requests[-1].hints == expected_own(None)
    assert response.json()["hicache_hints"] == own_outcomes()
    with client.stream("POST", "/v1/chat/completions",
                       json={**body, "stream": True}) as streamed:
        chunks = [json.loads(line.removeprefix("data: ")) for line in streamed.iter_lines()
                  if line and line != "data: [DONE]"]
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["hicache_hints"] == own_outcomes()
    assert all("hicache_hints" not in c for c in chunks if c is not final[0])


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("hint", "expected"), [
    ({"kind": "hold"}, "kind"),
    ({"kind": "pin", "input_ids": [1]}, "input_ids"),
    ({"kind": "pin", "ttl_s": -1}, "ttl_s"),
    ({"kind": "demote", "tier": "l3"}, "tier applies to pin only"),
    ({"kind": "pin", "tenant": "no spaces"}, "tenant"),
])
def test_a_malformed_hint_on_a_body_is_a_400(
    client: httpx.Client, engine: HintingEngine, route: str, hint: dict[str, Any],
    expected: str,
) -> None:
    before = len(engine.requests)
    prompt: dict[str, Any] = {
        "/generate": {"text": "hello"}, "/v1/completions": {"prompt": "hello"},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    }[route]
    response = client.post(route, json={**prompt, "hicache_hints": [hint]})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "hicache_hints" in message and expected in message
    assert len(engine.requests) == before


# ------------------------------------------------------------------------ metrics
def metrics_text(client: httpx.Client) -> str:
    response = client.get("/metrics")
    assert response.status_code == 200
    return response.text


def test_metrics_name_the_hint_series(client: httpx.Client, engine: HintingEngine) -> None:
    text = metrics_text(client)
    assert 'hicache_hints_total{kind="pin",outcome="accepted"} 2.0' in text
    assert 'hicache_hints_total{kind="retain",outcome="clipped"} 1.0' in text
    assert "hicache_pinned_pages 7.0" in text
    assert 'hicache_pinned_pages_tenant{tenant="acme"} 5.0' in text
    assert "hicache_retained_pages 3.0" in text
    assert "hicache_pin_budget_pages 64.0" in text
    for name in ("hicache_warm_requests_total", "hicache_warm_tokens_total"):
        assert f"{name} 0.0" in text


def test_tenant_series_are_bounded(client: httpx.Client, engine: HintingEngine) -> None:
    saved = engine.status
    many = {f"tenant{i:03d}": 1000 - i for i in range(200)}
    engine.status = {**saved, "pinned_pages_by_tenant": many}
    try:
        text = metrics_text(client)
    finally:
        engine.status = saved
    lines = [line for line in text.splitlines()
             if line.startswith("hicache_pinned_pages_tenant{")]
    assert len(lines) == MAX_TENANT_SERIES + 1
    assert 'hicache_pinned_pages_tenant{tenant="tenant000"} 1000.0' in lines
    rest = sum(1000 - i for i in range(MAX_TENANT_SERIES, 200))
    assert f'hicache_pinned_pages_tenant{{tenant="other"}} {float(rest)}' in lines


class WarmingEngine(HintingEngine):
    """An engine with L3 whose warm settles at once: the first item lands, the second
    is not in L3."""

    def storage_status(self) -> dict[str, Any]:
        return {"attached": True, "error": None}

    def warm_start(self, warm_id: str, items: list[list[int]],
                   max_host_fraction: float) -> dict[str, Any]:
        return {"done": True, "results": [
            {"index": 0, "outcome": "accepted", "tokens": len(items[0]), "reason": ""},
            {"index": 1, "outcome": "rejected", "tokens": 0, "reason": "not in L3"},
        ]}


def test_metrics_count_the_warm_calls() -> None:
    engine = WarmingEngine()
    with serve_app_in_thread(create_app(engine, admin_api_key=ADMIN)) as url, \
            httpx.Client(base_url=url, timeout=30.0) as http:
        warmed = http.post("/hicache/warm", json={"input_ids": [[1] * 32, [2] * 16]},
                           headers={"Authorization": f"Bearer {ADMIN}"})
        assert warmed.status_code == 200, warmed.text
        refused = http.post("/hicache/warm", json={"input_ids": []},
                            headers={"Authorization": f"Bearer {ADMIN}"})
        assert refused.status_code == 400  # not counted: it did not run
        text = metrics_text(http)
    assert "hicache_warm_requests_total 1.0" in text
    assert "hicache_warm_tokens_total 32.0" in text
    assert 'hicache_warm_items_total{outcome="accepted"} 1.0' in text
    assert 'hicache_warm_items_total{outcome="rejected"} 1.0' in text
