"""The most tokens a routed request may generate, as its body says (what it holds of a
worker's device while it decodes)."""

from __future__ import annotations

import pytest

from hicache.router.prompt import PromptKind, body_max_new_tokens


@pytest.mark.parametrize(("kind", "body", "expected"), [
    (PromptKind.GENERATE, {"sampling_params": {"max_new_tokens": 64}}, 64),
    (PromptKind.GENERATE, {"sampling_params": [{"max_new_tokens": 8}, {}]}, 8),  # a batch
    (PromptKind.GENERATE, {"sampling_params": {}}, None),
    (PromptKind.GENERATE, {"max_tokens": 5}, None),  # not a /generate field
    (PromptKind.COMPLETION, {"max_tokens": 16}, 16),
    (PromptKind.CHAT, {"max_completion_tokens": 32, "max_tokens": 16}, 32),
    (PromptKind.CHAT, {"max_tokens": -1}, None),
    (PromptKind.COMPLETION, {"max_tokens": True}, None),
    (PromptKind.COMPLETION, {"max_tokens": "16"}, None),
    (PromptKind.COMPLETION, {}, None),
])
def test_read_per_route(kind: PromptKind, body: dict[str, object], expected: int | None,
                        ) -> None:
    assert body_max_new_tokens(kind, body) == expected
