"""Page keys are the same in every process: they hash token bytes and a namespace seed with
xxhash, never Python's per-process salted ``hash``, so a store written by one server is
found by another."""

from __future__ import annotations

import subprocess
import sys

from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens


def test_page_keys_are_stable_across_processes() -> None:
    code = (
        "from hicache.radix.keys import KeyNamespace, chain_page_keys, pack_tokens;"
        "ns = KeyNamespace('m', 'kv', 4);"
        "print(chain_page_keys(pack_tokens(list(range(8))), 4, ns.seed('s'))[-1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ns = KeyNamespace("m", "kv", 4)
    expected = chain_page_keys(pack_tokens(list(range(8))), 4, ns.seed("s"))[-1]
    assert out.stdout.strip() == expected.hex()
