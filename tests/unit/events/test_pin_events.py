"""Pins in KV events (``BlockPinned``): the wire format round trip, the ``pin_events``
option that turns them on (off by default, so SGLang's router keeps decoding the
stream), and the emitter publishing a node's pins when the tree reports them."""

from __future__ import annotations

import msgspec
import pytest
import torch

from hicache.cache.hierarchical_cache import HierarchicalCache
from hicache.config import CacheConfig, ConfigError, IOBackendKind, WritePolicy
from hicache.events.config import parse_kv_events_config
from hicache.events.emitter import KVEventEmitter
from hicache.events.hashing import page_hashes
from hicache.events.messages import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockPinned,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from hicache.memory.geometry import KVGeometry
from hicache.radix.keys import unpack_tokens
from hicache.radix.node import TreeNode
from hicache.radix.observer import TierObserver
from tests.kv_oracle import serve
from tests.unit.events.test_emitter import Collected

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
PAGE = 4


def test_a_pin_event_round_trips_as_a_tagged_array() -> None:
    batch = KVEventBatch(ts=1.5, events=[
        BlockPinned([11, 12], True, MEDIUM_CPU), BlockPinned([11], False, MEDIUM_CPU),
    ])
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0] == ["BlockPinned", [11, 12], True, MEDIUM_CPU]


class SGLangBatch(msgspec.Struct, array_like=True, omit_defaults=True, tag=False):
    """A decoder that knows only SGLang's events (as SGLang's router decodes)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def test_a_decoder_without_pins_refuses_a_batch_with_one_but_reads_one_without() -> None:
    """Why pins are opt-in: one unknown tag costs that decoder the whole batch."""
    stored = BlockStored([1], None, [0] * PAGE, PAGE, None, MEDIUM_CPU)
    sglang = msgspec.msgpack.Decoder(SGLangBatch)
    assert sglang.decode(encode_batch(KVEventBatch(0.0, [stored]))).events == [stored]
    with pytest.raises(msgspec.ValidationError):
        sglang.decode(encode_batch(KVEventBatch(0.0, [stored, BlockPinned([1], True)])))


def test_pin_events_are_off_unless_the_config_asks() -> None:
    assert parse_kv_events_config('{"publisher": "zmq"}').pin_events is False
    assert parse_kv_events_config('{"publisher": "zmq", "pin_events": true}').pin_events
    with pytest.raises(ConfigError, match="pin_events must be true or false"):
        parse_kv_events_config('{"publisher": "zmq", "pin_events": 1}')


def test_an_observer_without_pins_inherits_a_no_op() -> None:
    class DeviceOnly(TierObserver):
        def device_stored(self, node: TreeNode) -> None:
            pass

    DeviceOnly().pins_changed(TreeNode(), True)  # nothing to do, nothing raised


def cache_with(pin_events: bool) -> tuple[HierarchicalCache, Collected, KVEventEmitter]:
    config = CacheConfig(
        page_size=PAGE, enable_hierarchical_cache=True, hicache_ratio=2.0,
        write_policy=WritePolicy.WRITE_THROUGH, io_backend=IOBackendKind.DIRECT,
    )
    sink = Collected()
    emitter = KVEventEmitter(PAGE, sink, pin_events=pin_events)
    return HierarchicalCache(config, GEOMETRY, 16, events=emitter), sink, emitter


def path_tokens(node: TreeNode) -> list[int]:
    tokens: list[int] = []
    cursor = node
    while cursor.parent is not None:
        tokens[:0] = unpack_tokens(cursor.tokens).tolist()
        cursor = cursor.parent
    return tokens


@pytest.mark.parametrize("pin_events", [True, False])
def test_the_emitter_publishes_a_nodes_pins_only_with_pin_events(pin_events: bool) -> None:
    cache, sink, emitter = cache_with(pin_events)
    try:
        prompt = list(range(1, 3 * PAGE + 1))
        serve(cache, prompt)
        cache.poll(wait=True)
        cache.publish_events()
        leaf = max(cache.tree.iter_nodes(), key=lambda n: len(path_tokens(n)))
        tokens = path_tokens(leaf)
        own = page_hashes(tokens, PAGE)[-(leaf.num_tokens // PAGE):]
        before = len(sink.events())
        emitter.pins_changed(leaf, True)
        emitter.pins_changed(leaf, False)
        cache.publish_events()
        pins = sink.events()[before:]
        if pin_events:
            assert pins == [BlockPinned(own, True, MEDIUM_CPU), BlockPinned(own, False, MEDIUM_CPU)]
        else:
            assert pins == []
    finally:
        cache.close()
