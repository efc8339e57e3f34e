"""What every route needs: the engine and its tokenizer, the model's public names, the
server's description, the admin settings, the metrics, and the request ids in flight."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request

from hicache.engine.api import EngineProtocol
from hicache.server.errors import APIError
from hicache.server.l3_path_root import resolve_root
from hicache.server.metrics import ServerMetrics
from hicache.server.server_info import ServerInfo
from hicache.tokenizer.base import Tokenizer

if TYPE_CHECKING:
    from hicache.server.drain import Drainer


class ServedEngine(EngineProtocol, Protocol):
    """The engine as the server uses it: the engine API plus its tokenizer, which the
    server uses for what the engine API does not cover (chat templates with tools and
    template variables, text with special tokens or untrimmed stops)."""

    tokenizer: Tokenizer


def last_path_component(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]


@dataclass
class ServerState:
    engine: ServedEngine
    served_model_name: str
    admin_api_key: str | None
    metrics: ServerMetrics
    info: ServerInfo
    # The attached L3 backend's extra config, secrets removed (the admin API updates it).
    storage_config: dict[str, Any] = field(default_factory=dict)
    # Whether the admin API may attach the "dynamic" backend, which imports and runs
    # any Python module it is given (--admin-allow-dynamic-backend).
    admin_allow_dynamic_backend: bool = False
    # Where the admin API may put an L3 store's files (--l3-path-root), resolved.
    l3_path_root: Path = field(default_factory=resolve_root)
    created: int = field(default_factory=lambda: int(time.time()))
    rids_in_flight: set[str] = field(default_factory=set)
    # --strict-model-name: a request naming another model is a 404 instead of served.
    strict_model_name: bool = False
    # The worker's drain (``server/drain.py``; None: an app built without one).
    drain: Drainer | None = None
    # The host-pool share a POST /hicache/warm may fill when its body names none.
    warm_host_fraction: float = 0.5

    @property
    def draining(self) -> bool:
        return self.drain is not None and self.drain.draining

    def check_model(self, model: str | None, strict: bool | None = None) -> None:
        """Whether a request's ``model`` may be served here: by default (as SGLang) any
        name, or none, is the one model served (sglang-router sends "unknown" when its
        client named none; agent frameworks send the name they were configured with).

        Strict (``--strict-model-name``, or ``strict`` for GET /v1/models/{id}, which
        asks whether a model exists): the served model, or (as SGLang) its last path
        component, or the tokenizer dir /model_info advertises; another name is a 404;
        no name at all is still the served model. The tokenizer dir: SGLang's clients
        name the model by the path they load the tokenizer from (bench_multiturn.py's
        ``--model-path``), which for a GGUF file or dummy weights is that dir rather
        than the served name.
        """
        if not (self.strict_model_name if strict is None else strict):
            return
        accepted = (self.served_model_name, last_path_component(self.served_model_name),
                    self.info.tokenizer_path)
        if model is not None and model not in accepted:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves "
                f"{self.served_model_name!r}", param="model",
            )

    def claim_rid(self, rid: str) -> None:
        """Hold ``rid`` while its request runs (``release_rid`` after): the engine tells
        requests apart by id, so a client-chosen id already in flight is refused, as
        SGLang does."""
        if rid in self.rids_in_flight:
            raise APIError(400, f"rid {rid!r} is already in flight: request ids must be unique",
                           param="rid")
        self.rids_in_flight.add(rid)

    def release_rid(self, rid: str) -> None:
        self.rids_in_flight.discard(rid)


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.hicache
    return state
