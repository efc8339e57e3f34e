"""The tokenizer interface: what the server, the engine and the router ask of a tokenizer.

``Tokenizer`` is encode / decode, the chat template, and the ids that end
generation. Its implementations: ``hf.HFTokenizer`` (a checkpoint's
tokenizer.json and chat template) and ``byte_level.ByteTokenizer`` (the fallback
for models without one); ``load.load_tokenizer`` picks between them. Streaming
decode lives in ``detokenizer``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from hicache.tokenizer.chat_template import Message


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used as asked; the message says why."""


class Tokenizer(ABC):
    bos_token_id: int | None
    # Any of these ends generation (e.g. Llama-3 instruct: <|end_of_text|> and <|eot_id|>).
    eos_token_ids: tuple[int, ...]

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Ids this tokenizer can decode: [0, vocab_size). Models may have more (padding)."""

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer adds (BOS)."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; ids outside the vocabulary decode to nothing."""

    @abstractmethod
    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt text for a conversation (with the assistant turn opened)."""

    def encode_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **variables: Any
    ) -> list[int]:
        # The template already writes BOS and the other specials as text.
        text = self.apply_chat_template(messages, add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False)
