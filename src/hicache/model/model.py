"""CausalLM: a Llama / Qwen2 / Qwen3 / DeepSeek-V2/V3 decoder whose KV lives in the paged pool.

One ``forward`` computes one step of a continuous-batching engine: the new
tokens of every sequence in a ``ForwardBatch`` (prefills, chunks, decodes,
mixed), writing their K/V into the pool and returning logits. The model holds
no per-request state: everything about a sequence's past is in the pool slots
the batch names, which is what lets the hierarchical cache hand it prefixes
computed by other requests, or loaded back from host memory.

Tensor parallelism (``tp``, one process per rank): each rank holds its part of
every layer (``hicache.distributed.sharding`` says which) and its KV heads' part of
the pool; the ranks sum their partial products after the row-parallel o and down
projections and after the vocab-parallel embedding, and gather the vocab-parallel
logits, so every rank returns the full logits of the step.

DeepSeek models (``config.mla``) have ``DeepseekLayer`` layers: multi-head latent
attention over a pool of one latent row per token per layer, the same on every
rank, and a MoE FFN; ``mla_form`` says how their attention is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hicache.attention.backend import AttentionBackend, make_attention_backend
from hicache.distributed.group import SINGLE_RANK, TPGroup
from hicache.distributed.sharding import RankShard, shard_model
from hicache.kernels.few_rows import FEW_ROWS_MAX, block, block_size, few_rows_linear
from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import KVGeometry
from hicache.model.attention import Attention, StepInputs
from hicache.model.batch import BatchError, ForwardBatch
from hicache.model.config import ModelConfig
from hicache.model.deepseek_layer import DeepseekLayer, MLAStepInputs
from hicache.model.errors import ModelConfigError
from hicache.model.layer_blocks import (
    attention_output,
    feed_forward,
    post_attention,
    pre_attention,
)
from hicache.model.linear import (
    PACKED_FROM_ROWS,
    column_major,
    column_major_is_faster,
    linear,
    prepack,
    sample_count,
    timed_products,
)
from hicache.model.mla_step import MLAForm, MLAStep
from hicache.model.mlp import SwiGLU
from hicache.model.norm import RMSNorm
from hicache.model.parameter import WeightShards, WeightViews, empty_parameter, part
from hicache.model.rotary import RotaryEmbedding


class LayerBlocks(NamedTuple):
    """The functions a layer runs before and after attention (eager or compiled)."""

    pre: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    post: Callable[..., torch.Tensor]
    # ``post`` in two halves, for tensor parallelism: the ranks sum each half's output.
    attention_output: Callable[..., torch.Tensor]
    feed_forward: Callable[..., torch.Tensor]


EAGER_BLOCKS = LayerBlocks(pre_attention, post_attention, attention_output, feed_forward)


# The row count the blocked copies are timed at against the packed ones (a decode step of
# a few requests): where they are not faster there, they are not used.
_FEW_ROWS_TIMED = 8


class ProjectionWeights(NamedTuple):
    """The weights a layer multiplies by: its parameters, oneDNN-packed copies, or blocked
    copies for products of a few rows (``hicache.kernels.few_rows``)."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        shard: RankShard,
        tp: TPGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, eps, device, dtype)
        self.self_attn = Attention(config, device, dtype, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, device, dtype)
        self.mlp = SwiGLU(
            config.hidden_size, config.intermediate_size, device, dtype, shard.intermediate
        )
        self.packed: ProjectionWeights | None = None  # set by CausalLM.prepack_weights
        # Products of fewer rows use the plain parameters (CausalLM.prepack_weights).
        self.packed_from_rows = PACKED_FROM_ROWS
        # Products of up to FEW_ROWS_MAX rows use these where set (CausalLM.prepack_weights).
        self.few_rows: ProjectionWeights | None = None

    def forward(
        self,
        x: torch.Tensor,
        step: StepInputs,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        blocks: LayerBlocks,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes the new tokens' K/V into the pool.

        ``keep_rows`` (the last layer, when only some rows' logits are wanted): every
        token's K/V is still written, but the output is [len(keep_rows), hidden], those
        rows only: no other row's o projection and MLP are computed."""
        attn = self.self_attn
        w = self._weights(x.shape[0])
        q_norm = attn.q_norm.weight if attn.q_norm is not None else None
        k_norm = attn.k_norm.weight if attn.k_norm is not None else None
        q, k, v = blocks.pre(
            x, self.input_layernorm.weight, w.qkv, attn.qkv_bias, q_norm, k_norm,
            step.cos, step.sin, attn.num_heads, attn.num_kv_heads, self.input_layernorm.eps,
        )
        # The pool holds post-RoPE keys: a cached prefix is reused without re-rotating.
        k_cache.index_copy_(0, step.out_slots, k)
        v_cache.index_copy_(0, step.out_slots, v)
        out = step.attention.attend(q, k, v, k_cache, v_cache)  # [T, heads, head_dim]
        if keep_rows is not None:
            out, x = out.index_select(0, keep_rows), x.index_select(0, keep_rows)
            w = self._weights(x.shape[0])  # few rows: maybe the one-row weights
        norm = self.post_attention_layernorm
        tp = self.tp
        if tp.size == 1:
            return blocks.post(
                out, x, w.o, attn.o_bias, norm.weight, w.gate_up, w.down, norm.eps
            )
        # Row-parallel o and down: each rank's product over its heads (its intermediate
        # columns), summed over the ranks; rank 0 alone adds the bias and the residual.
        first = tp.rank == 0
        h = tp.all_reduce_sum(
            blocks.attention_output(out, x if first else None, w.o, attn.o_bias if first else None)
        )
        return tp.all_reduce_sum(
            blocks.feed_forward(h, h if first else None, norm.weight, w.gate_up, w.down, norm.eps)
        )

    def _weights(self, rows: int) -> ProjectionWeights:
        """The weights a product of ``rows`` rows uses: the blocked copies up to
        FEW_ROWS_MAX rows where the model has them, else oneDNN-packed from
        ``packed_from_rows`` on, else the parameters."""
        if self.few_rows is not None and rows <= FEW_ROWS_MAX:
            return self.few_rows
        if self.packed is not None and rows >= self.packed_from_rows:
            return self.packed
        attn, mlp = self.self_attn, self.mlp
        return ProjectionWeights(attn.qkv_weight, attn.o_weight, mlp.gate_up_weight,
                                 mlp.down_weight)

    def hf_shards(self, prefix: str) -> WeightShards:
        return {
            **self.input_layernorm.hf_shards(f"{prefix}.input_layernorm"),
            **self.self_attn.hf_shards(f"{prefix}.self_attn"),
            **self.post_attention_layernorm.hf_shards(f"{prefix}.post_attention_layernorm"),
            **self.mlp.hf_shards(f"{prefix}.mlp"),
        }


class CausalLM(nn.Module):
    """Built empty (uninitialized) on ``device``; fill it with ``hicache.model.weights``.

    ``tp``: this process's rank of a tensor-parallel group; the model then holds the
    rank's part of the weights, reads a pool of the rank's KV heads
    (``kv_geometry()``), and runs its collectives in every forward, which all the
    group's ranks must call with the same batch. ``config`` stays the whole model's.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        attention_backend: str = "auto",
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or SINGLE_RANK
        self.shard = shard_model(config, self.tp.rank, self.tp.size)
        self.device = torch.device(device)
        # How attention reads the pool; swappable (tests compare backends on one model).
        self.attention_backend: AttentionBackend = make_attention_backend(
            attention_backend, self.device
        )
        self.packed_lm_head: torch.Tensor | None = None  # see prepack_weights
        self.one_row_lm_head: torch.Tensor | None = None  # see prepack_weights
        self.few_rows_lm_head: torch.Tensor | None = None  # see prepack_weights
        self.plain_weights_released = False  # see prepack_weights
        self.packed_from_rows = PACKED_FROM_ROWS  # see prepack_weights
        # The math around attention, eager until ``compile_blocks()``.
        self.blocks = EAGER_BLOCKS
        self.dtype = config.dtype
        dev, dtype = self.device, self.dtype
        # Vocab-parallel: the rank's rows of the vocabulary (all of them at TP=1).
        vocab_rows = self.shard.vocab.size
        self.embed_tokens = empty_parameter(vocab_rows, config.hidden_size, device=dev, dtype=dtype)
        # MLA models: absorbed or expanded attention, per sequence (``MLAForm``).
        self.mla_form = MLAForm.AUTO
        self.layers = nn.ModuleList(
            DeepseekLayer(config, index, dev, dtype, self.shard, self.tp)
            if config.mla is not None
            else DecoderLayer(config, dev, dtype, self.shard, self.tp)
            for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dev, dtype)
        # Tied models (Qwen3-0.6B) project logits with the embedding matrix itself.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else empty_parameter(vocab_rows, config.hidden_size, device=dev, dtype=dtype)
        )
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dev,
            dtype,
        )

    def prepack_weights(self, one_row: str = "auto") -> bool:
        """Pack every projection weight (and the LM head) for oneDNN, where it can (CPU,
        float32; see ``hicache.model.linear``); True if it did. The packed copies are
        used from then on; the parameters stay (``hf_weights`` sees them), so the weights'
        memory doubles: a CPU-sized model's few hundred MB.

        Products of a few rows (requests decoding) take one of three paths, ``one_row``:
        "blocked" (up to FEW_ROWS_MAX rows through blocked copies and the few-row kernel,
        ``hicache.kernels.few_rows``, read at memory speed: every row count then has a copy
        of its own, so the plain projection weights and an untied head are released and
        the memory stays about double; ``hf_weights`` and ``compile_blocks`` then refuse),
        "packed" (the packed copies for every row count), or "column-major" (one row
        through the parameters stored column-major, no further memory). "auto" times the
        blocked copies against the packed ones at a few rows and keeps them where they are
        faster; where they are not (or the kernel cannot run here), it times column-major
        against packed at one row and keeps the faster (``linear.column_major_is_faster``).

        Call it after the weights are loaded: a later change to a parameter is not seen.
        MLA models are not packed (False).
        """
        if self.config.mla is not None:
            return False
        if one_row not in ("auto", "blocked", "packed", "column-major"):
            raise ValueError(
                f"one_row must be auto, blocked, packed or column-major, not {one_row!r}"
            )
        packed_head = prepack(self.lm_head_weight)
        if packed_head is None:
            return False
        packs = []
        for layer in self.layers:
            packed = [prepack(w) for w in _projections(layer)]
            if any(p is None for p in packed):
                return False
            packs.append(ProjectionWeights(*packed))  # type: ignore[arg-type]
        params = [w for layer in self.layers for w in _projections(layer)]
        copies = [p for pack in packs for p in pack]
        if one_row in ("auto", "blocked") and self._block_weights(
            params, copies, timed=one_row == "auto"
        ):
            one_row = "blocked"
        elif one_row == "blocked":
            raise ValueError("one_row=blocked: the few-row kernel cannot run here")
        elif one_row == "auto":
            one_row = "column-major" if column_major_is_faster(params, copies) else "packed"
        columns = one_row == "column-major"
        self.packed_from_rows = PACKED_FROM_ROWS if columns else 1
        for layer, pack in zip(self.layers, packs, strict=True):
            assert isinstance(layer, DecoderLayer)
            layer.packed = pack
            layer.packed_from_rows = self.packed_from_rows
            if columns:
                # One-row products use the parameters themselves: stored column-major
                # from here on (same values, no extra memory).
                for param in _projections(layer):
                    param.data = column_major(param.data)
        self.packed_lm_head = packed_head
        if one_row == "blocked":
            self._release_plain_weights()
        if not columns:
            return True
        # The head's one-row product likewise; a head tied to the embedding keeps the
        # embedding's rows contiguous for lookups and gets a column-major copy of its own.
        if self.lm_head is None:
            self.one_row_lm_head = column_major(self.embed_tokens.detach())
        else:
            self.lm_head.data = column_major(self.lm_head.data)
        return True

    def weight_copies(self) -> list[torch.Tensor]:
        """The copies of the weights made by ``prepack_weights`` (oneDNN-packed, blocked,
        column-major head), besides the parameters."""
        copies = [self.packed_lm_head, self.few_rows_lm_head, self.one_row_lm_head]
        for layer in self.layers:
            if isinstance(layer, DecoderLayer):
                copies += [*(layer.packed or ()), *(layer.few_rows or ())]
        return [copy for copy in copies if copy is not None]

    def _release_plain_weights(self) -> None:
        """Free the plain projection weights (and an untied head) that no product reads any
        more: each keeps its shape and dtype as a zero-stride view of a single zero."""
        released = [w for layer in self.layers for w in _projections(layer)]
        if self.lm_head is not None:
            released.append(self.lm_head)
        for param in released:
            param.data = torch.zeros((), dtype=param.dtype, device=param.device).expand(
                param.shape
            )
        self.plain_weights_released = True

    def _check_plain_weights(self, what: str) -> None:
        if self.plain_weights_released:
            raise RuntimeError(
                f"{what}: the plain weights were released when the model's weights were "
                "blocked (prepack_weights); load the model again"
            )

    def _block_weights(
        self, params: list[nn.Parameter], packed: list[torch.Tensor], timed: bool
    ) -> bool:
        """Give every layer and the head blocked copies of their weights for products of a
        few rows; True if it did. Not where the kernel cannot take a weight, nor
        (``timed``) where products of a few rows over them are no faster here than over
        the ``packed`` copies (timed now over the first weights past the last-level
        cache, in turns)."""
        size = block_size()
        if size is None or any(w.shape[0] % size for w in params):
            return False  # (a layer's products must come out whole; the head's is cut)
        blocked = [block(w) for w in params]
        head = block(self.lm_head_weight)
        if head is None or any(b is None for b in blocked):
            return False
        copies: list[torch.Tensor] = [b for b in blocked if b is not None]
        if timed:
            count = sample_count(copies)
            few, onednn = timed_products(_FEW_ROWS_TIMED, copies[:count], packed[:count])
            if few >= onednn:
                return False
        for index, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            layer.few_rows = ProjectionWeights(*copies[4 * index: 4 * index + 4])
        self.few_rows_lm_head = head
        return True

    def compile_blocks(self) -> None:
        """Compile the math around attention (``torch.compile``, dynamic in the number of
        tokens): one compiled function for every layer, elementwise ops fused between
        the GEMMs. Attention stays the backend's (it reads the pool in place).

        It replaces prepacked weights (the compiler takes plain tensors): the two are
        alternatives, chosen by measurement (docs/benchmarks.md). MLA models stay eager.
        """
        if self.config.mla is not None:
            return
        self._check_plain_weights("compile_blocks")
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.packed = None
            layer.few_rows = None
        self.packed_lm_head = None
        self.one_row_lm_head = None
        self.few_rows_lm_head = None
        # torch.compile is lazy: the halves only a TP model calls are only compiled there.
        self.blocks = LayerBlocks(
            torch.compile(pre_attention, dynamic=True),
            torch.compile(post_attention, dynamic=True),
            torch.compile(attention_output, dynamic=True),
            torch.compile(feed_forward, dynamic=True),
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def kv_geometry(self) -> KVGeometry:
        """The geometry of the device pool this model reads: its rank's KV heads, its dtype."""
        return self.config.kv_geometry(self.dtype, tp_rank=self.tp.rank, tp_size=self.tp.size)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv: DevicePool,
        wait_layer: Callable[[int], None] | None = None,
        attention: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """Compute one step; returns float32 logits [len(batch.logit_rows()), vocab]: the
        last new token of each sequence, every new token with ``batch.return_all_logits``,
        or each sequence's tokens from ``batch.logits_from``.

        Per layer l: ``wait_layer(l)`` first (the cache orders this layer after any
        load of its K/V from host memory), then q/k/v, the new K/V written to the pool
        at ``batch.out_slots``, and attention over each sequence's context read from
        the pool through ``batch.page_table`` by the model's attention backend
        (``attention``, if given, instead: a recorded decode step's).
        """
        self._check(batch, kv)
        cos, sin = self.rotary.lookup(batch.positions)
        h = self._embed(batch.input_ids)  # [T, hidden]
        rows = batch.logit_rows()
        # Mostly only the last token of each sequence is sampled from: past the last
        # layer's K/V, nothing of the other rows is used, so that layer computes its o
        # projection and MLP for the sampled rows only (a prompt's whole last layer but
        # its q/k/v and attention: ~1/num_layers of its linear work), and the final norm
        # and vocabulary projection (a decode step's largest GEMM) skip them too.
        keep = (None if len(rows) == batch.num_tokens
                else torch.tensor(rows, device=h.device))
        if self.config.mla is not None:
            plan = MLAStep(batch, self.config.mla, self.mla_form)
            mla_step = MLAStepInputs(cos, sin, batch.out_slots, plan)
            for index, layer in enumerate(self.layers):
                if wait_layer is not None:
                    wait_layer(index)
                h = layer(h, mla_step, kv.latent_buffer(index))
            if keep is not None:
                h = h.index_select(0, keep)
        else:
            step = StepInputs(
                cos, sin, out_slots=batch.out_slots,
                attention=(attention or self.attention_backend).prepare(batch),
            )
            last = len(self.layers) - 1
            for index, layer in enumerate(self.layers):
                if wait_layer is not None:
                    wait_layer(index)
                h = layer(h, step, kv.k_buffer(index), kv.v_buffer(index), self.blocks,
                          keep if index == last else None)
        logits = self._head(self.norm(h)).float()  # [rows, the rank's vocab rows]
        return self.tp.all_gather_last_dim(logits, self.shard.vocab_sizes)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The vocabulary projection of the rows ``x``, over the copy of the head weight
        their number of rows uses (``prepack_weights``)."""
        head = self.lm_head_weight
        if self.few_rows_lm_head is not None and x.shape[0] <= FEW_ROWS_MAX:
            logits = few_rows_linear(x, self.few_rows_lm_head, out_features=self.shard.vocab.size)
            if logits is not None:
                return logits
        if self.packed_lm_head is not None and x.shape[0] >= self.packed_from_rows:
            head = self.packed_lm_head
        elif self.one_row_lm_head is not None and x.shape[0] < self.packed_from_rows:
            head = self.one_row_lm_head
        return linear(x, head)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]; vocab-parallel: each rank looks up the tokens of
        its rows, zeros for the others', and the sum over ranks is every token's row."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed_tokens)
        vocab = self.shard.vocab
        local = input_ids - vocab.start
        outside = (local < 0) | (local >= vocab.size)
        h = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        return self.tp.all_reduce_sum(h.masked_fill_(outside.unsqueeze(-1), 0.0))

    def _check(self, batch: ForwardBatch, kv: DevicePool) -> None:
        expected = self.kv_geometry()
        if kv.geometry != expected:
            raise ModelConfigError(
                f"device pool geometry {kv.geometry.describe()} does not fit the model "
                f"({expected.describe()}); build it with model.kv_geometry()"
            )
        if not _same_device(kv.device, self.device):
            raise ModelConfigError(f"device pool is on {kv.device}, the model on {self.device}")
        longest = max(batch.seq_lens)
        if longest > self.config.max_position_embeddings:
            raise BatchError(
                f"a sequence reaches {longest} tokens, past the model's "
                f"max_position_embeddings ({self.config.max_position_embeddings})"
            )

    def hf_weights(self) -> WeightViews:
        """Every parameter (or fused part of one) under its Hugging Face checkpoint name
        (under tensor parallelism: the rank's part of it)."""
        return {name: shard.target for name, shard in self.hf_shards().items()}

    def hf_shards(self) -> WeightShards:
        """Where each Hugging Face checkpoint tensor, or the rank's part of it, goes."""
        self._check_plain_weights("hf_shards")
        config, vocab = self.config, self.shard.vocab
        table_shape = (config.vocab_size, config.hidden_size)
        shards: WeightShards = {
            "model.embed_tokens.weight": part(self.embed_tokens, table_shape, 0, vocab.start)
        }
        for index, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer | DeepseekLayer)
            shards.update(layer.hf_shards(f"model.layers.{index}"))
        shards.update(self.norm.hf_shards("model.norm"))
        if self.lm_head is not None:
            shards["lm_head.weight"] = part(self.lm_head, table_shape, 0, vocab.start)
        return shards


def _projections(layer: nn.Module) -> tuple[nn.Parameter, ...]:
    assert isinstance(layer, DecoderLayer)
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """cuda and cuda:0 name the same device when 0 is the current one."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current
    )
