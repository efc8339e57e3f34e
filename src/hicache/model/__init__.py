"""The model layer: Llama / Qwen2 / Qwen3 and DeepSeek decoders over the paged KV pool, weights.

Entry points: ``loader.load_model`` (model + config + tokenizer, from a model dir,
a GGUF file converted once into the local cache, or a preset) and
``model.CausalLM.forward`` (one engine step over a ``batch.ForwardBatch``).

What is here: the decoders (``model.py``, with DeepSeek's layer, multi-head latent
attention and MoE beside it), the layers' weights and math (``attention.py``: an
attention layer's weights; ``layer_blocks.py``, ``linear.py``, ``mlp.py``,
``norm.py``, ``rotary.py``, ``yarn.py``), the configs (``config.py``,
``deepseek_config.py``; their errors in ``errors.py``) and the weights: loading
(``loader.py``, ``weights.py``), GGUF files (``gguf.py``, ``gguf_cache.py``,
``safetensors_writer.py``), dummy presets, the default model and the weights'
identity for the L3 namespace (``identity.py``). What is not: attention over the
paged pool, one module per backend with its kernel, is ``hicache.attention``;
tokenizers, chat templates and detokenizing are ``hicache.tokenizer``.

This file imports nothing: importing a torch-free module of the package
(``errors``, ``default_model``) must not pull in torch and the models with it,
which is what keeps ``hicache router`` and the tokenizer package torch-free.
Import what you need from its own module.
"""
