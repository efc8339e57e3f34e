"""The caller's identity on the model routes: ``--api-keys`` and ``--tenant-header``.

``TenantMiddleware`` stands in front of the routes that generate or touch a
tenant's cache (``is_tenant_route``: /generate, /v1/*, /hicache/hints, /tokenize,
/detokenize). With ``--api-keys`` a request there without a known
``Authorization: Bearer <key>`` is a 401 before the route runs (nothing is read
or queued); a ``--tenant-header`` value that is no tenant name is a 400. What it
learns (``identity.Caller``) rides in the request's state for the route, which
resolves the tenant with its body's cache key (``request_tenant``, precedence in
``tenancy.identity``). Other routes (health, metrics, the admin API with its own
key) are not asked for a tenant key.

Invariant: every engine request and hint a route builds takes its ``extra_key``
from ``request_tenant``, so a key's tenant holds on every path.
"""

from __future__ import annotations

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from hicache.server.access_log import record_tenant
from hicache.server.errors import error_response
from hicache.tenancy.identity import ANONYMOUS, Caller, IdentityError, TenantIdentity

STATE_KEY = "hicache_caller"
_EXACT_ROUTES = frozenset({"/generate", "/hicache/hints", "/tokenize", "/detokenize"})


def is_tenant_route(path: str) -> bool:
    return path in _EXACT_ROUTES or path.startswith("/v1/")


class TenantMiddleware:
    """See the module docstring."""

    def __init__(self, app: ASGIApp, identity: TenantIdentity) -> None:
        self.app = app
        self.identity = identity

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_tenant_route(scope["path"]):
            request = Request(scope)
            try:
                caller = self.identity.caller(request.headers)
            except IdentityError as error:
                headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
                await error_response(error.status, error.message, headers=headers)(
                    scope, receive, send)
                return
            scope.setdefault("state", {})[STATE_KEY] = caller
        await self.app(scope, receive, send)


def request_caller(request: Request) -> Caller:
    """The identity the middleware found (anonymous on a server without one)."""
    caller = request.scope.get("state", {}).get(STATE_KEY)
    return caller if isinstance(caller, Caller) else ANONYMOUS


def request_tenant(request: Request, body_key: str | None) -> str | None:
    """The request's tenant, its engine ``extra_key``: ``body_key`` (the body's
    ``cache_salt``/``extra_key``) resolved against the caller's identity."""
    tenant = request_caller(request).tenant(body_key)
    record_tenant(tenant)  # the access log names the tenant it served
    return tenant
