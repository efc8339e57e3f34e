"""Tokenizers, chat templates and streaming detokenization, without torch.

``base`` is what the server and the router use (``Tokenizer``, ``HFTokenizer``
over a tokenizer.json, the byte-level ``ByteTokenizer``, ``load_tokenizer``);
``chat_template`` renders a checkpoint's Jinja template, ``chat_content`` shapes
message content for it, ``detokenizer`` turns a growing token sequence into text
deltas, ``gguf`` rebuilds a GGUF file's tokenizer as tokenizer files and
``byte_level_dir`` writes the byte-level tokenizer out for clients.

Invariant: no module here imports torch, directly or through another hicache
package (tests/unit/test_router_imports.py), so ``hicache router`` tokenizes
prompts without loading it. Nothing is imported here: import from the module.
"""
