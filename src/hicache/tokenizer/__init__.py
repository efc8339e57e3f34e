"""Tokenizers, chat templates and streaming detokenization, without torch.

``base.Tokenizer`` is what the server, the engine and the router use; ``hf``
implements it over a checkpoint's tokenizer.json, ``byte_level`` over UTF-8
bytes for models without one, and ``load.load_tokenizer`` picks between them.
``chat_template`` renders a checkpoint's Jinja template, ``chat_content`` shapes
message content for it, ``detokenizer`` turns a growing token sequence into text
deltas, ``gguf`` rebuilds a GGUF file's tokenizer as tokenizer files and
``byte_level_dir`` writes the byte-level tokenizer out for clients.

Invariant: no module here imports torch, directly or through another hicache
package (tests/e2e/test_router_imports.py), so ``hicache router`` tokenizes
prompts without loading it. Nothing is imported here: import from the module.
"""
