"""``hicache bench tree``: latency of the radix tree's hot operations.

The tree is shaped like multi-turn traffic: ``conversations`` x ``turns`` turns
of ``turn_tokens`` tokens, each turn extending the previous one, so a whole
conversation is a path of ``turns`` nodes (defaults: 64 x 16 x 2K tokens at page
64, a tree of ~2M tokens). Measured, each as the median of many runs:
- insert: a 32K-token prompt sharing all but its last turn with a cached
  conversation (walks 15 nodes, adds one leaf), and the same with the new
  leaf's page keys computed (what L3 backup needs; the shared prefix's keys
  were computed when it was cached);
- match: a full hit along a 16-node path;
- evict: 64K tokens from the device tier (LRU), with the tree full;
- page keys for a whole 32K-token prompt, from scratch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from hicache.config import WritePolicy
from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens
from hicache.radix.tree import HiRadixTree


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--turn-tokens", type=int, default=2048)
    parser.add_argument("--evict-tokens", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", type=str, default=None, help="write raw results here")


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _build(args: argparse.Namespace, rng: np.random.Generator) -> tuple[HiRadixTree, list[bytes]]:
    ns = KeyNamespace("bench", "L32-H8-D128-bfloat16", args.page_size)
    tree = HiRadixTree(args.page_size, WritePolicy.WRITE_THROUGH, ns)
    pages_per_turn = args.turn_tokens // args.page_size
    next_page = 0
    conversations: list[bytes] = []
    for _ in range(args.conversations):
        tokens = rng.integers(0, 150_000, size=args.turns * args.turn_tokens, dtype=np.int32)
        data = pack_tokens(tokens)
        for turn in range(1, args.turns + 1):
            prefix = data[: turn * args.turn_tokens * 4]
            # As a request would: the cached prefix's own pages, then fresh ones.
            cached = tree.match_prefix(prefix).device_pages
            fresh = np.arange(next_page, next_page + pages_per_turn, dtype=np.int64)
            inserted = tree.insert(prefix, np.concatenate([cached, fresh]))
            # Keys of every cached page, as once an L3 backup has seen them: the
            # insert below then hashes only its new leaf (the steady state).
            tree.page_keys(inserted.last_node)
            next_page += pages_per_turn
        conversations.append(data)
    return tree, conversations


def main(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(0)
    build_start = time.perf_counter()
    tree, conversations = _build(args, rng)
    build_s = time.perf_counter() - build_start
    total_tokens = tree.num_device_pages * args.page_size
    total_nodes = tree.num_nodes
    prompt_tokens = args.turns * args.turn_tokens
    turn_bytes = args.turn_tokens * 4

    # match: a full hit along a whole conversation (one node per turn).
    match_s = []
    for i in range(args.repeats):
        data = conversations[i % len(conversations)]
        match_s.append(_time(partial(tree.match_prefix, data)))
    raw = np.frombuffer(conversations[0], dtype=np.int32).copy()
    match_array_s = [_time(lambda: tree.match_prefix(raw)) for _ in range(args.repeats)]
    hit = tree.match_prefix(conversations[0])
    assert hit.num_tokens == prompt_tokens, "benchmark tree is not shaped as intended"

    # insert: all turns but the last shared, a new last turn.
    insert_s, insert_keys_s = [], []
    page = tree.num_device_pages
    pages_per_turn = args.turn_tokens // args.page_size
    for i in range(args.repeats):
        base = conversations[i % len(conversations)][:-turn_bytes]
        new_turn = pack_tokens(rng.integers(0, 150_000, size=args.turn_tokens, dtype=np.int32))
        prompt = base + new_turn
        fresh = np.arange(page, page + pages_per_turn, dtype=np.int64)
        pages = np.concatenate([tree.match_prefix(base).device_pages, fresh])
        page += pages_per_turn
        if i % 2 == 0:
            insert_s.append(_time(partial(tree.insert, prompt, pages)))
        else:
            def insert_with_keys(p: bytes = prompt, q: np.ndarray = pages) -> None:
                tree.page_keys(tree.insert(p, q).last_node)

            insert_keys_s.append(_time(insert_with_keys))

    # page keys of a whole prompt, from scratch.
    seed = tree.seed(None)
    keys_s = [
        _time(lambda: chain_page_keys(conversations[0], args.page_size, seed))
        for _ in range(max(10, args.repeats // 10))
    ]

    # evict: LRU device eviction of evict_tokens, repeated on the full tree.
    evict_pages = args.evict_tokens // args.page_size
    evict_s = []
    for _ in range(min(args.repeats, tree.num_device_pages // evict_pages // 2)):
        evict_s.append(_time(lambda: tree.evict_device(evict_pages)))
    tree.check_integrity()

    results = {
        "page_size": args.page_size,
        "tree_tokens": total_tokens,
        "tree_nodes": total_nodes,
        "build_s": build_s,
        "insert_32k_shared_us": _median_us(insert_s),
        "insert_32k_shared_with_page_keys_us": _median_us(insert_keys_s),
        "match_16_node_full_hit_us": _median_us(match_s),
        "match_16_node_full_hit_from_int32_array_us": _median_us(match_array_s),
        "evict_64k_tokens_us": _median_us(evict_s),
        "page_keys_32k_prompt_us": _median_us(keys_s),
    }
    targets = {
        "insert_32k_shared_us": 150.0,
        "insert_32k_shared_with_page_keys_us": 150.0,
        "match_16_node_full_hit_us": 60.0,
        "evict_64k_tokens_us": 1000.0,
    }
    print(
        f"tree: {total_tokens:,} tokens in {total_nodes:,} nodes, page {args.page_size} "
        f"(built in {build_s:.1f} s)"
    )
    print(f"{'operation':<46}{'median us':>11}{'target us':>11}")
    for name, value in results.items():
        if name.endswith("_us"):
            target = targets.get(name)
            print(f"{name:<46}{value:>11.1f}{'' if target is None else f'{target:>11.0f}'}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0
