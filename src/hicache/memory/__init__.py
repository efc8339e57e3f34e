"""KV memory: the device (L1) and host (L2) pools, their page allocator, and their sizes.

- ``geometry``: the KV shape of one rank (layers, planes: K and V or MLA's latent,
  heads, head dim, dtype); ``layout``: page layouts as strides over one flat buffer, so
  copies between layouts are indexing on one canonical view;
- ``allocator``: page ids of one pool, handed out and taken back;
- ``device_pool``: L1, layer_first, what attention reads in place;
- ``host_pool``: L2 in layer_first, page_first or page_first_direct; with CUDA pinned to
  exactly its size (``host_memory``: cudaHostRegister, not torch's power-of-two
  allocator), without it 2 MiB-aligned private memory whose first
  ``PREFAULT_BYTES`` of page ids are faulted in when the pool is made, the rest while
  the engine is idle (``prefault``);
- ``page_digests``: per host page, the L3 frame checksum of its bytes where the cache
  took it: KNOWN (computed while copying the page in) or EXPECTED (claimed by an L3
  frame, verified by the load to the device);
- ``machine_memory``: what the process may still take (MemAvailable, every memory
  cgroup's headroom, ``HICACHE_AVAILABLE_MEMORY``) and what it holds; ``sizing``: a pure
  function from those, a reserve and a page's bytes to the pools' page counts, or a
  refusal below ``MIN_PAGES_PER_REQUEST`` device pages per running request. The engine
  builds the pools from that plan, logs it, and reports it (``memory`` in
  /get_server_info, ``hicache_memory_*`` in /metrics).

Invariants: page ids are int64 numpy arrays in all bookkeeping (tensors only at the
transfer boundary); every pool and allocator has ``check_integrity``; when the host pool
is on it is larger than the device pool, and one larger than the machine can spare is
refused at start-up.
"""
