"""Cache hints as HTTP bodies name them, and their conversion to the engine's ``Hint``.

Two shapes share the fields of a hint (``kind``, ``ttl_s``, ``tier``, ``tenant``):

- ``HintItem``, one item of ``POST /hicache/hints``: it names its prefix, as token ids
  (``input_ids``) or a text (``text``, tokenized as /generate tokenizes a prompt),
  exactly one of them, with an optional ``cache_salt`` (the namespace of
  ``extra_key``/``cache_salt`` on /generate);
- ``RequestHint``, one item of ``hicache_hints`` on /generate, /v1/completions and
  /v1/chat/completions: no prefix, the hint is about the request's own prompt and
  output, in the request's own cache namespace.

Invariants: a TTL is a finite number of seconds above 0 and only pin and retain take
one; a tier ("host" or "l3") only on pin; a tenant is 1-64 of ``[A-Za-z0-9_.-]`` (it is
a metrics label and a budget key, so nothing free-form); unknown fields are refused.
The engine clips what it must (TTLs past its maximum, budgets): a body is refused here
only when it cannot mean anything.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hicache.engine.api import Hint, HintKind
from hicache.server.errors import APIError

# More hints than this in one call is a flood, not a list of conversations.
MAX_ITEMS = 1024
TENANT_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"
DEFAULT_TENANT = "default"
HintKindName = Literal["pin", "unpin", "retain", "prefetch", "demote"]
# The kinds that keep pages for a while: they take a TTL.
_TTL_KINDS = frozenset({"pin", "retain"})


class RequestHint(BaseModel):
    """A hint about a request's own prefix (``hicache_hints`` on a generation body)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kind: HintKindName
    ttl_s: float | None = None
    tier: Literal["host", "l3"] | None = None
    tenant: str = Field(default=DEFAULT_TENANT, pattern=TENANT_PATTERN)

    @model_validator(mode="after")
    def _fits_the_kind(self) -> RequestHint:
        if self.ttl_s is not None:
            if self.kind not in _TTL_KINDS:
                raise ValueError(f"ttl_s applies to pin and retain, not {self.kind}")
            if not math.isfinite(self.ttl_s) or self.ttl_s <= 0:
                raise ValueError(f"ttl_s must be a finite number of seconds > 0, "
                                 f"got {self.ttl_s}")
        if self.tier is not None and self.kind != "pin":
            raise ValueError(f"tier applies to pin only, not {self.kind}")
        return self

    def to_hint(
        self, input_ids: tuple[int, ...] | None, extra_key: str | None,
        identity: str | None = None,
    ) -> Hint:
        """The engine's hint; an authenticated caller's pins are charged to its own tenant
        (``identity``): naming another is a ValueError, so no key holder spends another
        tenant's pin budget."""
        tenant = self.tenant
        if identity is not None:
            if "tenant" in self.model_fields_set and self.tenant != identity:
                raise ValueError(f"tenant {self.tenant!r} is not the caller's tenant "
                                 f"{identity!r}: leave it out")
            tenant = identity
        return Hint(
            kind=HintKind(self.kind), input_ids=input_ids, ttl_s=self.ttl_s,
            tier=self.tier or "host", tenant=tenant, extra_key=extra_key,
        )


class HintItem(RequestHint):
    """One item of ``POST /hicache/hints``: a hint and the prefix it is about."""

    input_ids: list[int] | None = None
    text: str | None = None
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _one_prefix(self) -> HintItem:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("give exactly one of input_ids (token ids) or text")
        if not (self.input_ids if self.input_ids is not None else self.text):
            raise ValueError(f"{'input_ids' if self.input_ids is not None else 'text'} "
                             "is empty: name the prefix the hint is about")
        return self


def request_hints(
    hints: list[RequestHint] | None, extra_key: str | None, identity: str | None = None,
) -> tuple[Hint, ...]:
    """A generation body's ``hicache_hints`` as the engine request's own hints (an
    APIError 400 for a tenant that is not the authenticated caller's ``identity``)."""
    out = []
    for index, hint in enumerate(hints or ()):
        try:
            out.append(hint.to_hint(None, extra_key, identity))
        except ValueError as error:
            raise APIError(400, f"hicache_hints[{index}]: {error}",
                           param=f"hicache_hints[{index}]") from None
    return tuple(out)
