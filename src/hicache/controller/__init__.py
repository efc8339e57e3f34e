"""Moving pages between L1 and L2 in the background: ``CacheController`` and its executors.

``CacheController`` (``controller``) owns two executors (``executor``: a CUDA stream on
a GPU, a worker thread on the CPU), one for device->host writes and one for host->device
loads. It knows pages, not trees: the cache tells it what to copy and learns by polling
which writes landed.

Invariants: writes are acknowledged strictly in submission order (the landed ones form a
prefix, which tensor-parallel ranks agree on as one number); loads go one submission per
layer, so layer l+1 loads while layer l computes; with a CPU device, pages read from L3
and not yet verified (EXPECTED digests) are loaded whole, checked on the way and waited
for (``load_verified``), and no device page past the first that fails is used.
"""
