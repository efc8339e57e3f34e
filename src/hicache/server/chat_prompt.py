"""A chat request's prompt: its messages through the model's chat template, as token ids.

The template sees what transformers' ``apply_chat_template`` gives it for the
same conversation: the messages as the client sent them, except that each
assistant tool call's ``arguments`` (JSON text in the OpenAI API) is parsed
into an object, which is what tool-use templates expect (SGLang and vLLM do
the same); ``tools`` (null without tools, or with ``tool_choice: "none"``);
the request's ``chat_template_kwargs`` as further variables. With
``continue_final_message`` the prompt ends inside the last (assistant)
message instead of opening a new one.

Content follows the OpenAI API per role: an assistant message may leave it out
or null (one carrying ``tool_calls`` does, in every agent loop); a system,
developer, user or tool message must have it (a 400 otherwise). How content
reaches the template (parts joined or kept, null as "", non-text parts refused)
is ``hicache.tokenizer.chat_content``'s rule, applied by the tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

from hicache.server.chat_protocol import ChatCompletionRequest
from hicache.server.errors import APIError
from hicache.tokenizer.base import Tokenizer
from hicache.tokenizer.chat_template import continue_final_message

# Fields of a reply's message that a client sends back unchanged; not part of the conversation
# as a chat template sees it (a refusal's text stands in for absent content).
REPLY_ONLY_FIELDS = {"refusal", "annotations", "audio", "function_call"}


def template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template sees them."""
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(body.messages):
        if message.content is None and message.role != "assistant":
            raise APIError(
                400, f"messages.{index}.content is missing or null: a {message.role} message "
                "needs content (a string or a list of text parts); only an assistant message "
                "may leave it out", param=f"messages.{index}.content",
            )
        data = message.model_dump(exclude_unset=True, exclude=REPLY_ONLY_FIELDS)
        if data.get("content") is None and message.refusal is not None:
            data["content"] = message.refusal
        for number, call in enumerate(data.get("tool_calls") or ()):
            call.pop("index", None)  # a streaming detail, not part of the conversation
            function = call["function"]
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                raise APIError(
                    400, f"messages.{index}.tool_calls.{number}.function.arguments is not JSON",
                    param=f"messages.{index}.tool_calls.{number}.function.arguments",
                ) from None
        messages.append(data)
    return messages


def chat_prompt_ids(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    if body.input_ids is not None:
        if not body.input_ids:
            raise APIError(400, "input_ids is empty", param="input_ids")
        return list(body.input_ids)
    messages = template_messages(body)
    variables: dict[str, Any] = {**(body.chat_template_kwargs or {}),
                                 "tools": body.template_tools()}
    try:
        if body.continue_final_message:
            text = continue_final_message(
                lambda marked: tokenizer.apply_chat_template(
                    marked, add_generation_prompt=False, **variables
                ),
                messages,
            )
        else:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 **variables)
    except ValueError as error:  # ChatTemplateError and TokenizerError are ValueErrors
        raise APIError(400, f"messages: {error}", param="messages") from None
    # The template writes BOS and the other special tokens as text.
    return tokenizer.encode(text, add_special_tokens=False)
