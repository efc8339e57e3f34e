"""A checkpoint's tokenizer: tokenizer.json through ``tokenizers``, tokenizer_config.json's
special tokens and Jinja chat template.

The ``tokenizers`` package is imported when a tokenizer is loaded, not with this
module. Ids outside the vocabulary decode to nothing (models may pad theirs).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.tokenizer.base import Tokenizer, TokenizerError
from hicache.tokenizer.chat_content import ContentError, takes_content_parts, template_content
from hicache.tokenizer.chat_template import ChatTemplate, ChatTemplateError, Message

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
