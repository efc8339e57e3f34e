"""Rendering a model's Jinja chat template (from tokenizer_config.json) into a prompt.

The environment is the one transformers gives templates (sandboxed, trimmed
blocks, ``tojson`` with its arguments, ``raise_exception``, ``strftime_now``),
so a checkpoint's template renders here as ``apply_chat_template`` renders it.
``continue_final_message`` renders a conversation so that the model goes on
writing its last (assistant) message instead of starting a new one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The template is malformed, or refused the messages (its raise_exception)."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: object, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:
    # Templates embed tool schemas with tojson; jinja2's own escapes HTML characters,
    # which would put "\u003c" where the model was trained to see "<". The arguments
    # are transformers' (templates call e.g. tojson(indent=4) or tojson(separators=...)).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
        sort_keys=sort_keys,
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template, rendered in a sandbox (templates ship with checkpoints).

    Whitespace control follows the convention the templates are written for:
    ``trim_blocks`` and ``lstrip_blocks`` on, so block tags leave no stray newlines.
    """

    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt text; ``variables`` reach the template (bos_token, tools, ...)."""
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except TypeError as e:
            # A template's own operation on what the messages hold ("str" + a list or
            # None ...): the messages are what it cannot take, not the server.
            raise ChatTemplateError(f"chat template failed: {e}") from e


# Appended to the final message's text to find where it ends in the rendered prompt.
# It ends in a space: finding it without that space means the template trimmed the
# message's trailing whitespace, and the prompt must end trimmed too.
_CONTINUE_MARK = "<|hicache-continue-final-message|> "


def continue_final_message(
    render: Callable[[list[dict[str, Any]]], str], messages: Sequence[Message]
) -> str:
    """The prompt that continues the last message: rendered without a generation prompt
    (``render`` does that), cut right where the last message's text ends, so that
    whatever the template writes after a message (end-of-turn tokens) is left out."""
    if not messages:
        raise ChatTemplateError("continue_final_message needs a message to continue")
    marked = [dict(m) for m in messages]
    last = marked[-1]
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + _CONTINUE_MARK
    elif isinstance(content, list):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
        texts = [i for i, p in enumerate(parts) if isinstance(p, dict) and "text" in p]
        if not texts:
            raise ChatTemplateError("continue_final_message: the last message has no text")
        part = parts[texts[-1]]
        part["text"] = str(part["text"]) + _CONTINUE_MARK
        last["content"] = parts
    else:
        raise ChatTemplateError("continue_final_message: the last message has no content")
    rendered = render(marked)
    at = rendered.rfind(_CONTINUE_MARK.rstrip())
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not write the last message's "
            "text as given, so it cannot be continued"
        )
    if rendered.startswith(_CONTINUE_MARK, at):
        return rendered[:at]
    return rendered[:at].rstrip()
