"""What every route needs: the engine, the model's public name, the admin settings, the metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from hicache.engine.api import EngineProtocol
from hicache.server.errors import APIError
from hicache.server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: EngineProtocol
    served_model_name: str
    admin_api_key: str | None
    metrics: ServerMetrics
    # Whether the admin API may attach the "dynamic" backend, which imports and runs
    # any Python module it is given (--admin-allow-dynamic-backend).
    admin_allow_dynamic_backend: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, model: str | None) -> None:
        """OpenAI requests name the model; a name this server does not serve is a 404."""
        if model is not None and model != self.served_model_name:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves "
                f"{self.served_model_name!r}", param="model",
            )


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.hicache
    return state
