"""Rendering a model's Jinja chat template (from tokenizer_config.json) into a prompt."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The template is malformed, or refused the messages (its raise_exception)."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: object, indent: int | None = None) -> str:
    # Templates embed tool schemas with tojson; jinja2's own escapes HTML characters,
    # which would put "\u003c" where the model was trained to see "<".
    return json.dumps(value, ensure_ascii=False, indent=indent)


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
