"""The hierarchical cache: one object that drives the radix tree, both pools, the
copies between them and the L3 tier together.

- ``hierarchical_cache.py``: ``HierarchicalCache``, what the scheduler talks to
  (acquire, alloc, insert, release, prefetch, poll). It drives ``hicache.radix``'s
  tree, ``hicache.memory``'s device (L1) and host (L2) pools and
  ``hicache.controller``'s background copies between them, and proves with
  ``check_integrity()`` that every page has exactly one owner;
- ``l3.py``: the L3 tier as the cache drives it (prefetch L3 -> L2, backup L2 -> L3)
  over a ``hicache.storage`` controller, turning its finished operations into tree
  and allocator changes;
- ``l3_context.py``: ``L3Context``, all the tier may see and change of the cache; the
  tier reaches the cache through it alone;
- ``l3_agreement.py``: under tensor parallelism, what the ranks agree on about L3
  each tick (the tier decides only from the agreed values);
- ``drain.py``, ``warm.py``: L1 and L2 written to L3 before an exit; prefixes read from L3
  into L2 ahead of their requests;
- ``hints.py``: ``HintBook``, what pin, unpin, retain, prefetch and demote hints do;
- ``stats.py``: the counters of what the cache did.

Everything here runs on the scheduler thread.
"""
