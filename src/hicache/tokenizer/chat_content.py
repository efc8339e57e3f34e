"""Message content as a chat template expects it: OpenAI content parts, null content.

The OpenAI API lets a message's ``content`` be a string, a list of parts
(``[{"type": "text", "text": "..."}]``, what the OpenAI SDK, LangChain and the
Agents SDK send) or, on an assistant message carrying ``tool_calls``, null or
absent. Chat templates are written for one of two shapes: most
(SmolLM2's, Llama's, Qwen2.5's) concatenate ``message['content']`` as a string;
some (vision models', Qwen3's) iterate over it as parts.

The rule, applied to every message before the template sees it:

- null or absent content is the empty string (templates that test ``if
  message.content`` skip it, as they skip None; ones that concatenate it do not
  fail on None);
- a list of parts becomes the joined text of its parts (``TEXT_PART_SEPARATOR``
  between them, as vLLM does for string templates), unless the template takes
  parts (``takes_content_parts``), which then gets the list, each part reduced
  to ``{"type": "text", "text": ...}``;
- a part is a text part (``type: "text"`` with a string ``text``) or, on an
  assistant message, a refusal part (``type: "refusal"``, its ``refusal`` as
  text); any other part (``image_url``, ``input_audio``, ``file`` ...) is a
  ``ContentError`` naming its type: no model served here reads anything but text.

A template takes parts when it renders a user message whose content is one text
part without failing and writes the part's text, not the list's repr (a
template that writes ``{{ message['content'] }}`` whatever it is would write
``[{'type': 'text', ...}]``); a template that fails on the list gets strings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

TEXT_PART_SEPARATOR = "\n"
_PROBE_TEXT = "hicache content probe"


class ContentError(ValueError):
    """A message's content the template cannot be given; the message says which and why."""


def takes_content_parts(render: Callable[[list[dict[str, Any]]], str]) -> bool:
    """Whether the template behind ``render`` (messages -> prompt, raising ValueError
    when the template fails) reads content given as a list of text parts."""
    part = {"type": "text", "text": _PROBE_TEXT}
    try:
        rendered = render([{"role": "user", "content": [part]}])
    except ValueError:
        return False
    return _PROBE_TEXT in rendered and repr(part) not in rendered


def part_text(part: object, role: object, where: str) -> str:
    """The text of one content part; ``where`` names it in errors (``messages.1.content.0``)."""
    if not isinstance(part, Mapping):
        raise ContentError(f"{where} must be a content part object, got {part!r}")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise ContentError(f"{where} is a text part without a 'text' string")
        return text
    if kind == "refusal" and role == "assistant":
        refusal = part.get("refusal")
        if not isinstance(refusal, str):
            raise ContentError(f"{where} is a refusal part without a 'refusal' string")
        return refusal
    raise ContentError(
        f"{where} is a content part of type {kind!r}, which this server does not take: "
        "the model reads text only (parts of type 'text')"
    )


def template_content(
    messages: Sequence[Mapping[str, Any]], takes_parts: bool
) -> list[dict[str, Any]]:
    """The messages with their content in the shape the template takes (see the module)."""
    out = []
    for index, message in enumerate(messages):
        copy = dict(message)
        content = copy.get("content")
        if content is None:
            copy["content"] = ""
        elif isinstance(content, list):
            texts = [part_text(part, copy.get("role"), f"messages.{index}.content.{number}")
                     for number, part in enumerate(content)]
            copy["content"] = [{"type": "text", "text": t} for t in texts] if takes_parts \
                else TEXT_PART_SEPARATOR.join(texts)
        elif not isinstance(content, str):
            raise ContentError(
                f"messages.{index}.content must be a string or a list of content parts"
            )
        out.append(copy)
    return out
