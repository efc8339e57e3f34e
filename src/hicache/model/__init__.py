"""The model layer: Llama / Qwen2 / Qwen3 and DeepSeek decoders over the paged KV pool, weights.

Entry points: ``loader.load_model`` (model + config + tokenizer, from a model dir,
a GGUF file converted once into the local cache, or a preset) and
``model.CausalLM.forward`` (one engine step over a ``batch.ForwardBatch``).
Tokenizers live in ``hicache.tokenizer``.

This file imports nothing: importing a torch-free module of the package
(``errors``, ``default_model``) must not pull in torch and the models with it,
which is what keeps ``hicache router`` and the tokenizer package torch-free.
Import what you need from its own module.
"""
