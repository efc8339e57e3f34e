"""Tokenizers: a checkpoint's tokenizer.json + chat template, or the byte-level fallback.

``Tokenizer`` is what the server uses: encode / decode, the chat template, and
the ids that end generation. ``load_tokenizer(path)`` picks ``HFTokenizer``
when the model dir has a tokenizer.json and ``ByteTokenizer`` otherwise (dummy
models). Streaming decode lives in ``hicache.tokenizer.detokenizer``.
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.tokenizer.chat_content import ContentError, takes_content_parts, template_content
from hicache.tokenizer.chat_template import ChatTemplate, ChatTemplateError, Message

logger = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------- HF tokenizer.json
# Longer id lists are decoded through the batch call (see HFTokenizer.decode); shorter ones,
# a streamed chunk's, through the single call, which costs less per call.
_LONG_DECODE_IDS = 4096


class HFTokenizer(Tokenizer):
    """A ``tokenizers`` fast tokenizer (tokenizer.json) plus tokenizer_config.json's
    special tokens and Jinja chat template."""

    def __init__(
        self,
        tokenizer: Any,  # tokenizers.Tokenizer
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._tok = tokenizer
        try:
            self._template = ChatTemplate(chat_template) if chat_template else None
        except ChatTemplateError as e:
            # A checkpoint's broken template is a tokenizer problem for whoever loads it.
            raise TokenizerError(str(e)) from e
        # Whether the template reads content parts (chat_content.takes_content_parts),
        # probed on the first chat.
        self._takes_parts: bool | None = None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._special_id(bos_token, "bos_token")
        eos_id = self._special_id(eos_token, "eos_token")
        ids = ([eos_id] if eos_id is not None else []) + list(extra_eos_token_ids)
        self.eos_token_ids = tuple(dict.fromkeys(ids))  # de-duplicated, order kept

    def _special_id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{what} {token!r} is not in the tokenizer's vocabulary")
        return int(token_id)

    @classmethod
    def from_dir(
        cls, model_path: str | Path, extra_eos_token_ids: Iterable[int] = ()
    ) -> HFTokenizer:
        """tokenizer.json, tokenizer_config.json (and chat_template.jinja) of a model dir."""
        from tokenizers import Tokenizer as FastTokenizer

        root = Path(model_path)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{root}: no tokenizer.json")
        try:
            tok = FastTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{path}: cannot be loaded: {e}") from e
        config: dict[str, Any] = {}
        config_path = root / "tokenizer_config.json"
        if config_path.is_file():
            with config_path.open() as f:
                config = json.load(f)
        return cls(
            tok,
            chat_template=_chat_template_source(root, config),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            extra_eos_token_ids=extra_eos_token_ids,
        )

    @property
    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` itself (grammars read its vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Through the batch call, which releases the interpreter lock while it tokenizes:
        # the single-text ``encode`` holds it throughout (seconds for megabytes of text),
        # so no other thread ran meanwhile, the server's event loop included, even with
        # the call on a worker thread. Same ids; the fast variant skips character offsets.
        batch = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        vocab_size = self.vocab_size  # once: the property asks the Rust tokenizer each time
        ids = [t for t in token_ids if 0 <= t < vocab_size]
        if len(ids) > _LONG_DECODE_IDS:  # as in encode: the batch call lets other threads run
            return str(self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0])
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        if self._template is None:
            raise TokenizerError(
                "this tokenizer has no chat template (tokenizer_config.json 'chat_template'); "
                "send a plain prompt instead"
            )
        variables.setdefault("bos_token", self.bos_token or "")
        variables.setdefault("eos_token", self.eos_token or "")
        template = self._template
        if self._takes_parts is None:  # probed once (a race only probes twice)
            self._takes_parts = takes_content_parts(
                lambda probe: template.render(probe, False, bos_token=variables["bos_token"],
                                              eos_token=variables["eos_token"])
            )
        try:
            shaped = template_content(messages, self._takes_parts)
            return template.render(shaped, add_generation_prompt, **variables)
        except (ChatTemplateError, ContentError) as e:
            raise TokenizerError(str(e)) from e


def _token_text(value: object) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_source(root: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    # Newer checkpoints keep the template in its own file.
    path = root / "chat_template.jinja"
    return path.read_text() if path.is_file() else None


# ---------------------------------------------------------------------- byte-level fallback
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




def load_tokenizer(
    model_path: str | Path | None, extra_eos_token_ids: Iterable[int] = ()
) -> Tokenizer:
    """The model dir's tokenizer.json, or the byte-level fallback when there is none."""
    if model_path is not None and (Path(model_path) / "tokenizer.json").is_file():
        return HFTokenizer.from_dir(model_path, extra_eos_token_ids)
    if model_path is not None:
        logger.warning("%s has no tokenizer.json: using the byte-level tokenizer", model_path)
    return ByteTokenizer(eos_token_ids=extra_eos_token_ids)
