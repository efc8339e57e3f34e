"""The byte-level tokenizer: UTF-8 bytes as tokens, for models that have no tokenizer.

Ids 0-255 are the bytes, 256 on the specials (``ByteTokenizer.SPECIALS``);
``byte_level_dir`` writes the same tokenizer out as files for clients.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from hicache.tokenizer.base import Tokenizer, TokenizerError
from hicache.tokenizer.chat_content import ContentError, template_content
from hicache.tokenizer.chat_template import Message


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens 0-255, then a few specials; for models without a tokenizer.

    Chat format: ``<|bos|>`` then each message as ``<|role|>content<|end|>``, and
    ``<|assistant|>`` to open the reply.

    Generation ends on the model's own end-of-sequence ids when it names any
    (``eos_token_ids``: config.json's and generation_config.json's), as it would
    with its real tokenizer: the specials' ids (256-261) are ordinary tokens of
    such a model. A model that names none (dummy weights) ends on ``<|eos|>`` and
    ``<|end|>``.
    """

    SPECIALS = ("<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    _ROLES = ("system", "user", "assistant")

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        self._special_ids = {text: 256 + i for i, text in enumerate(self.SPECIALS)}
        self._special_text = {i: text for text, i in self._special_ids.items()}
        # One pass over the UTF-8 bytes finds every special (ASCII: no multi-byte character
        # contains one). Alternatives in sorted order: where two specials would match at
        # one place (one a prefix of the other) the shorter wins, as it always has.
        self._special_bytes_ids = {text.encode(): i for text, i in self._special_ids.items()}
        alternatives = b"|".join(re.escape(s) for s in sorted(self._special_bytes_ids))
        self._special_split = re.compile(b"(" + alternatives + b")").split
        self.bos_token_id = self._special_ids["<|bos|>"]
        own_eos = (self._special_ids["<|eos|>"], self._special_ids["<|end|>"])
        model_eos = tuple(dict.fromkeys(eos_token_ids))  # de-duplicated, order kept
        self.eos_token_ids = model_eos or own_eos

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        # Linear in the text: bytes, special, bytes, special, ..., bytes.
        parts = self._special_split(text.encode("utf-8"))
        ids += parts[0]
        for special, data in zip(parts[1::2], parts[2::2], strict=True):
            ids.append(self._special_bytes_ids[special])
            ids += data
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        run = bytearray()
        for token in token_ids:
            if 0 <= token < 256:
                run.append(token)
                continue
            if token in self._special_text and not skip_special_tokens:
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
                parts.append(self._special_text[token])
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        parts = ["<|bos|>"]
        try:  # content as a string template's (chat_content): parts joined, null empty
            shaped = template_content(messages, takes_parts=False)
        except ContentError as e:
            raise TokenizerError(str(e)) from e
        for message in shaped:
            role = message.get("role")
            if role not in self._ROLES:
                raise TokenizerError(f"role {role!r} is not supported; use one of {self._ROLES}")
            parts.append(f"<|{role}|>{message['content']}<|end|>")
        if add_generation_prompt:
            parts.append("<|assistant|>")
        return "".join(parts)
