"""Attention over the paged device pool: the backend interface and one module per backend.

``backend`` holds the interface (``AttentionBackend`` turns a step's ``ForwardBatch``
into an ``AttentionStep`` once; every layer calls ``attend`` on it) and
``make_attention_backend``, which picks one by name or per device. Each backend is one
module holding its Python side and its kernel: ``gather`` (the reference every other
backend is tested against), ``cpu`` (a C++ decode kernel, ``cpu_paged_attention.cpp``),
``triton`` (its JIT kernels in ``triton_jit``, imported at first launch) and
``flashinfer``; ``sdpa`` is the causal SDPA over fresh K/V they share for cold prompts.
Invariant shared by all: every layer has written the step's new K/V into the pool
before it attends, so a backend reads every key from there.

``triton`` and ``flashinfer`` import their library only when first used, so they
import where it is missing (``triton_jit`` is the one module that imports Triton).
"""
