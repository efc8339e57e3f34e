"""The /v1/chat/completions bodies: messages with tool calls, tools, and the chat response.

A conversation replayed by an agent carries assistant messages with
``tool_calls`` (each ``function.arguments`` a JSON string, as OpenAI sends
it) and ``tool`` messages answering them by ``tool_call_id``. ``tools`` and
``tool_choice`` say which functions the model may call; ``chat_template_kwargs``
reaches the chat template as variables (``enable_thinking`` ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hicache.engine.api import GrammarSpec
from hicache.server.protocol import (
    OFF,
    OFF_FALSE,
    SglExt,
    StrictModel,
    Usage,
    _OpenAISampling,
    neutral,
)
from hicache.server.structured_output import (
    one_grammar,
    response_format_grammar,
    tool_call_grammar,
)

# Template variables the request's own fields set; chat_template_kwargs may not override them.
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt")


class ContentPart(BaseModel):
    # Other part types (images ...) pass validation here and are refused by the
    # chat template with a message naming what is supported.
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as the OpenAI API writes it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # sent back by clients that echo streamed deltas


class ChatMessage(StrictModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages
    reasoning_content: str | None = None  # assistant messages of reasoning models
    # What the OpenAI client sends back when a loop appends a reply's message object to its
    # next request: accepted, not shown to the template. A refusal's text stands in for
    # absent content (it is what the assistant said); the others only at their empty values.
    refusal: str | None = None
    annotations: Annotated[Any, neutral(None, [])] = None
    audio: Annotated[Any, OFF] = None
    function_call: Annotated[Any, OFF] = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_form(cls, value: Any) -> Any:
        if value is None or isinstance(value, str | list):
            return value
        raise ValueError("content must be a string or a list of content parts")

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role!r} ones")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    # "required" and a named function: the output is forced to be tool calls (to that
    # function), with arguments valid against its parameters (structured_output.py).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # False: a forced answer holds one call. (With "auto", every call the model writes
    # is returned.)
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    # Token ids of the prompt, already templated (SGLang): the messages are not rendered.
    input_ids: list[int] | None = None
    # SGLang's router sends these; without a reasoning parser they change nothing.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # The chosen tokens' logprobs, and (top_logprobs) the N most likely at each position.
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: Any = None  # text, json_object or json_schema (structured_output.py)
    # Accepted only at their neutral values (see Neutral).
    reasoning_effort: Annotated[Any, OFF] = None
    task: Annotated[Any, OFF] = None
    return_meta_info: Annotated[Any, OFF_FALSE] = False
    max_dynamic_patch: Annotated[Any, OFF] = None
    min_dynamic_patch: Annotated[Any, OFF] = None
    use_audio_in_video: Annotated[Any, OFF_FALSE] = False

    @model_validator(mode="after")
    def _check_chat_only(self) -> ChatCompletionRequest:
        reserved = sorted(set(self.chat_template_kwargs or ()) & set(RESERVED_TEMPLATE_VARIABLES))
        if reserved:
            raise ValueError(
                f"chat_template_kwargs may not set {reserved}: use the request's own fields"
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        return self

    def grammar(self) -> GrammarSpec | None:
        return one_grammar(super().grammar(), response_format_grammar(self.response_format),
                           self._forced_tool_calls())

    def _forced_tool_calls(self) -> GrammarSpec | None:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return None
        tools = self.tools or []
        if not tools:
            raise ValueError(f"tool_choice {_choice_text(choice)} needs tools")
        offered = [(tool.function.name, tool.function.parameters) for tool in tools]
        if isinstance(choice, NamedToolChoice):
            offered = [(name, schema) for name, schema in offered
                       if name == choice.function.name]
            if not offered:
                raise ValueError(
                    f"tool_choice names function {choice.function.name!r}, which is not "
                    f"among the tools ({', '.join(t.function.name for t in tools)})"
                )
        return tool_call_grammar(offered, parallel=self.parallel_tool_calls is not False)

    @property
    def tools_enabled(self) -> bool:
        """Whether the model is shown the tools (and its output parsed for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them: the OpenAI schema, as sent."""
        if not self.tools_enabled:
            return None
        assert self.tools is not None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


def _choice_text(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


# ------------------------------------------------------------------ responses
class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None  # see logprobs_format.chat_logprobs
    finish_reason: str | None
    matched_stop: int | str | None = None  # as SGLang: the stop token id or string


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    sglext: SglExt | None = None
    hicache_hints: list[dict[str, Any]] | None = None  # outcomes of the request's hints
