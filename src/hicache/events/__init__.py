"""KV events for routers, in SGLang's and vLLM's format: which pages a worker holds, by tier.

- ``config``: ``--kv-events-config`` (off by default; a bad key fails the start);
- ``hashing``: SGLang's chained page hashes, which a router computes from token ids;
- ``messages``: the msgspec messages and the media (GPU, CPU_PINNED, EXTERNAL);
- ``emitter``: the cache's tier transitions (the tree's ``TierObserver``, landed host
  copies, L3 puts and prefetches, flushes, and pins with ``pin_events``) as one
  ``KVEventBatch`` per scheduler step;
- ``publisher``: a ZMQ PUB socket and a replay ROUTER socket, on a thread of its own.

Invariants: the scheduler thread only enqueues (no I/O, never blocks); batches carry
consecutive sequence numbers from 0, so a subscriber sees gaps and restarts; with events
off nothing here runs and no page is hashed.
"""
