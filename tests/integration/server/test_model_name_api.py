"""The model a request names: as SGLang, a single-model server serves its model to a request
naming another one ("unknown", which sglang-router sends when its client named none) or none;
``--strict-model-name`` keeps the 404 for a name it does not serve. GET /v1/models/{id}
asks whether a model exists: another name is a 404 either way."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import httpx
import openai
import pytest

from hicache.server.serve import add_arguments
from tests.server_fixtures import RunningServer, serve_in_thread

SERVED = "org/Tiny-Chat"
ROUTES = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
    ("/tokenize", {"prompt": "hi"}),
]


@pytest.fixture(scope="module", params=[False, True], ids=["default", "strict"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[RunningServer, bool]]:
    with serve_in_thread(served_model_name=SERVED, strict_model_name=request.param) as running:
        yield running, request.param


@pytest.mark.parametrize(("route", "body"), ROUTES, ids=[r for r, _ in ROUTES])
def test_a_request_naming_no_or_another_model(
    server: tuple[RunningServer, bool], route: str, body: dict[str, object]
) -> None:
    running, strict = server
    with httpx.Client(base_url=running.url, timeout=60.0) as client:
        unnamed = client.post(route, json=body)
        assert unnamed.status_code == 200, unnamed.text
        for name in ("unknown", "gpt-4o"):
            named = client.post(route, json={**body, "model": name})
            if strict:
                assert named.status_code == 404, named.text
                assert f"the model {name!r} does not exist" in named.json()["error"]["message"]
            else:
                assert named.status_code == 200, named.text
                if route.startswith("/v1/"):
                    assert named.json()["model"] == SERVED  # the model that answered


def test_the_openai_client_with_any_model_name(server: tuple[RunningServer, bool]) -> None:
    running, strict = server
    with openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0,
                       timeout=60.0) as client:
        if strict:
            with pytest.raises(openai.NotFoundError, match="does not exist"):
                client.chat.completions.create(
                    model="unknown", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        else:
            reply = client.chat.completions.create(
                model="unknown", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert reply.model == SERVED and reply.choices[0].finish_reason is not None
        # Retrieving a model asks whether it exists: only the served one does.
        assert client.models.retrieve(SERVED).id == SERVED
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("unknown")


def test_the_serve_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).strict_model_name is False
    assert parser.parse_args(["--strict-model-name"]).strict_model_name is True
