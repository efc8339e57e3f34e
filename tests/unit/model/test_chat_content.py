"""Which templates take content parts, and the content each is given (chat_content's rule)."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.tokenizer.chat_content import ContentError, takes_content_parts, template_content
from hicache.tokenizer.chat_template import ChatTemplate


def probe(source: str) -> bool:
    template = ChatTemplate(source)
    return takes_content_parts(lambda messages: template.render(messages, False))


@pytest.mark.parametrize(
    ("source", "takes"),
    [
        # Concatenates strings (SmolLM2, Llama): fails on a list.
        ("{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}", False),
        # Writes content whatever it is: a list would reach the prompt as its repr.
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
        # Iterates over parts (vision models' templates).
        ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
         "{% endfor %}", True),
    ],
    ids=["concatenates", "writes-repr", "iterates"],
)
def test_a_template_takes_parts_only_when_it_reads_their_text(source: str, takes: bool) -> None:
    assert probe(source) is takes


def test_content_shapes() -> None:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "a", "cache_control": {}},
                                   {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                {"role": "assistant", "content": None}, {"role": "assistant"}]
    assert [m["content"] for m in template_content(messages, takes_parts=False)] == \
        ["a\nb", "no", "", ""]
    kept = template_content(messages, takes_parts=True)
    assert kept[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert messages[0]["content"] is parts  # the caller's messages are left as they were
    with pytest.raises(ContentError, match=r"messages\.0\.content\.0 is a content part of type "
                                           "'refusal'"):
        template_content([{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}],
                         takes_parts=False)
