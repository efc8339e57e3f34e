"""The radix tree over KV pages: which prefix's KV lives on the device, the host, or both.

``HiRadixTree`` (``tree``) is pure CPU bookkeeping at page granularity: each node
(``node``) is a run of whole pages with its device and host page ids, its locks (path
counts, so a split keeps them) and the hit count the write policy reads (a node is backed
up to the host at its first hit under write_through, its second under
write_through_selective, on eviction under write_back). Eviction is LRU per tier;
``results`` types what the tree's operations return; ``observer`` is told of each tier
transition the tree decides (where the KV events start); ``keys`` chains 128-bit page
keys in a namespace (model, KV geometry, tensor-parallel layout, cache salt), the names
of pages in L3.

Invariants: the tree holds page ids, never tensors, and does no I/O; a page belongs to
at most one node per tier; ``HiRadixTree.check_integrity`` asserts every structural
invariant and names the one broken.
"""
