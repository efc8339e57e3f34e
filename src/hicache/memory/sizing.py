"""How large the KV pools are: from the flags, or from what the machine can spare.

``plan_pools`` is a pure function of ``SizingInputs`` (what the machine has, what this
process already holds, the page's bytes, the flags) to a ``PoolPlan`` or a
ConfigError naming what is missing. A pool the user sized with a flag keeps that
size; a pool left to the default is sized here ("auto"):

- The budget is what is available (``machine_memory.available_memory``), less a share
  left to the rest of the machine (``MACHINE_SHARE``), less this process's resident
  memory counted once for every other tensor-parallel rank (they share the machine and
  may not have loaded their weights when this rank looked), split evenly over the
  ranks, less a reserve per rank (``reserve_bytes``) for what the process allocates
  after the pools: activations, requests, I/O buffers.
- CPU device pool with the host pool on: the two pools are host memory alike and
  share the budget one to two, the host pool twice the device pool (the ratio the
  flags default to; L2 must stay larger than L1), and the device pool at most
  ``CPU_KV_POOL_TOKENS`` (the default before sizing existed: more buys nothing a
  CPU can compute). Without the host pool, the device pool takes the budget alone.
- A device pool of fixed size (``--max-total-tokens``, or GPU memory by
  ``--mem-fraction-static``): the host pool is twice it when the budget allows, else
  the whole budget; when that is not larger than the device pool, a device pool
  taken from GPU memory by default shrinks to half of it (the host pool twice the
  rest), and one the user sized is refused.
- The floor: ``MIN_PAGES_PER_REQUEST`` device pages per running request
  (``--max-running-requests``), and a host pool twice that; less is refused.

Invariants of every plan: ``host_pages > device_pages`` when the host pool is on
(0 when off), ``device_pages >= 2``, and an auto plan's pools fit its budget:
``pools_in_host_memory_bytes <= budget`` whenever the available memory is known.
The plan's ``announced_bytes`` (resident + reserve + the pools in host memory) is
what the process should stay within; the end-to-end test measures it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.config import ConfigError
from hicache.memory.machine_memory import AvailableMemory

# Device pages per running request below which an auto-sized pool is refused: a
# request needs its prompt's pages and a page to decode into; with fewer, requests
# would mostly wait for each other's pages.
MIN_PAGES_PER_REQUEST = 4
# The host pool as a multiple of the device pool when auto-sized (the flag's default).
AUTO_HOST_RATIO = 2
# What the pools never take of the available memory, for the rest of the machine: the
# HTTP process's growth, the page cache the model's files are read from, other jobs.
# An eighth, at most 10 GiB (the reserve of a host pool sized by flags is a quarter, which
# would leave a 3 GB machine nothing to serve with).
MACHINE_SHARE = 8
MACHINE_SHARE_MAX_BYTES = 10 << 30
# The reserve: what the engine process allocates past its pools. Measured with
# SmolLM2-135M on the CPU (float32, 256-token steps, 8 and 16 concurrent 1.6K-token
# prompts, every third asking the prompt's logprobs, and the end-to-end test's load): the
# process grew 145-221 MB past its resident size at sizing, its device pool and the host
# pages in use (or the host pool's prefaulted part). The reserve, 316 MB for that model, is
# 1.4x the most seen: a fixed part for what does not scale with the model (glibc's heap
# and arenas that freed activations stay in, thread stacks, requests' token lists and
# the radix tree's nodes, an L3 backend's buffers) ...
RESERVE_BASE_BYTES = 192 << 20
# ... and a step's activations: the widest tensors of one token in a layer (hidden,
# attention, MLP) for every token of a step, and a row of logits for every row that keeps
# its logits (a decode row, a prompt's last token, the prompt rows of a request asking
# its prompt's logprobs), twice (a layer's input and output live at once). 170 MB for
# SmolLM2's default CPU steps (1,024 tokens, of which at most 256 prompt rows and 32
# decode rows keep logits).
ACTIVATION_COPIES = 2


def machine_share_bytes(available_bytes: int) -> int:
    """What the pools leave of ``available_bytes`` to the rest of the machine."""
    return min(MACHINE_SHARE_MAX_BYTES, available_bytes // MACHINE_SHARE)


def reserve_bytes(
    tokens_per_step: int, hidden_size: int, intermediate_size: int, vocab_size: int,
    dtype_bytes: int, activations_on_host: bool, logit_rows: int | None = None,
) -> int:
    """What the process allocates past its pools: ``RESERVE_BASE_BYTES``, and on the CPU
    the activations of a step of ``tokens_per_step`` tokens of which at most ``logit_rows``
    (default: all) keep their logits (on a GPU they are in GPU memory)."""
    if not activations_on_host:
        return RESERVE_BASE_BYTES
    rows = tokens_per_step if logit_rows is None else min(logit_rows, tokens_per_step)
    per_step = tokens_per_step * (4 * hidden_size + 3 * intermediate_size) + rows * vocab_size
    return RESERVE_BASE_BYTES + ACTIVATION_COPIES * per_step * dtype_bytes


@dataclass(frozen=True)
class SizingInputs:
    """What ``plan_pools`` decides from (one tensor-parallel rank's view)."""

    available: AvailableMemory | None  # None: the system does not say
    resident_bytes: int  # this process now, weights loaded
    weights_bytes: int  # of which the model's parameters
    reserve_bytes: int
    page_bytes: int  # one page of this rank's KV
    page_size: int  # tokens per page
    max_running_requests: int
    hierarchical: bool  # a host (L2) pool
    device_in_host_memory: bool  # the device pool is host memory too (CPU)
    # A device pool of fixed size (a flag, or GPU memory); None: sized here (CPU only).
    device_pages: int | None = None
    # The flag that fixed it, as given ("--max-total-tokens 16384"): such a pool is never
    # shrunk. None with device_pages: GPU memory by the default fraction.
    device_flag: str | None = None
    max_device_pages: int = 4096  # the auto device pool's cap
    tp_size: int = 1


@dataclass(frozen=True)
class PoolPlan:
    """The pools' sizes, where each came from, and the figures they were chosen from."""

    device_pages: int
    host_pages: int  # 0: no host pool
    page_bytes: int
    page_size: int
    device_source: str  # "auto", "flags" or "gpu"
    host_source: str  # "auto", "flags" or "off"
    device_in_host_memory: bool
    available: AvailableMemory | None = None
    resident_bytes: int = 0
    weights_bytes: int = 0
    reserve_bytes: int = 0
    budget_bytes: int | None = None  # what the pools in host memory could take (auto)
    reason: str = ""

    @property
    def auto_sized(self) -> bool:
        return "auto" in (self.device_source, self.host_source)

    @property
    def device_pool_bytes(self) -> int:
        return self.device_pages * self.page_bytes

    @property
    def host_pool_bytes(self) -> int:
        return self.host_pages * self.page_bytes

    @property
    def pools_in_host_memory_bytes(self) -> int:
        device = self.device_pool_bytes if self.device_in_host_memory else 0
        return device + self.host_pool_bytes

    @property
    def announced_bytes(self) -> int:
        """The host memory this process should stay within: what it held when the pools
        were sized, the reserve, and the pools that are host memory."""
        return self.resident_bytes + self.reserve_bytes + self.pools_in_host_memory_bytes

    def describe(self) -> str:
        """One log line: the figures, then the sizes chosen and why."""
        gb = _gb
        available = (
            f"available {gb(self.available.bytes)} ({self.available.source}; "
            f"{gb(machine_share_bytes(self.available.bytes))} of it left to the machine)"
            if self.available is not None else "available memory unknown"
        )
        host = (f"host pool {self.host_pages} pages, {gb(self.host_pool_bytes)} "
                f"({self.host_source})" if self.host_pages else "no host pool")
        return (
            f"memory: {available}, this process {gb(self.resident_bytes)} (weights "
            f"{gb(self.weights_bytes)}), reserve {gb(self.reserve_bytes)} -> device pool "
            f"{self.device_pages * self.page_size} tokens, {gb(self.device_pool_bytes)} "
            f"({self.device_source}), {host}; {self.reason}; announced "
            f"{gb(self.announced_bytes)} of host memory"
        )


def plan_pools(inputs: SizingInputs) -> PoolPlan:
    """The pools for ``inputs`` when at least one is left to the default (see the module
    docstring); ConfigError when the machine cannot spare the smallest that serve."""
    page = inputs.page_bytes
    if page <= 0:
        raise ConfigError(f"page_bytes must be positive, got {page}")
    budget = _budget(inputs)
    floor = max(2, MIN_PAGES_PER_REQUEST * inputs.max_running_requests)
    if inputs.device_pages is None:
        device, reason = _auto_device(inputs, budget, floor)
        host = AUTO_HOST_RATIO * device if inputs.hierarchical else 0
        device_source = "auto"
    else:
        device, host, reason = _fixed_device(inputs, budget, floor)
        device_source = "flags" if inputs.device_flag is not None else "gpu"
    return PoolPlan(
        device_pages=device, host_pages=host, page_bytes=page, page_size=inputs.page_size,
        device_source=device_source, host_source="auto" if inputs.hierarchical else "off",
        device_in_host_memory=inputs.device_in_host_memory, available=inputs.available,
        resident_bytes=inputs.resident_bytes, weights_bytes=inputs.weights_bytes,
        reserve_bytes=inputs.reserve_bytes, budget_bytes=budget, reason=reason,
    )


def _budget(inputs: SizingInputs) -> int | None:
    """Bytes this rank's pools in host memory may take; None when unknown."""
    if inputs.available is None:
        return None
    available = inputs.available.bytes
    machine = machine_share_bytes(available)
    others = (inputs.tp_size - 1) * inputs.resident_bytes
    return (available - machine - others) // inputs.tp_size - inputs.reserve_bytes


def _auto_device(inputs: SizingInputs, budget: int | None, floor: int) -> tuple[int, str]:
    cap = max(inputs.max_device_pages, 2)
    cap_tokens = cap * inputs.page_size
    if budget is None:
        return cap, f"the default {cap_tokens}-token device pool (available memory unknown)"
    shares = 1 + (AUTO_HOST_RATIO if inputs.hierarchical else 0)
    per_page = inputs.page_bytes * (shares if inputs.device_in_host_memory else shares - 1)
    fits = budget // per_page if per_page else cap
    if fits >= cap:
        return cap, f"the default {cap_tokens}-token device pool fits"
    if fits < floor:
        raise ConfigError(_too_little(inputs, budget, floor * per_page, floor))
    return fits, f"shrunk to fit {_gb(budget)}"


def _fixed_device(
    inputs: SizingInputs, budget: int | None, floor: int
) -> tuple[int, int, str]:
    device = inputs.device_pages
    assert device is not None
    page = inputs.page_bytes
    if not inputs.hierarchical:
        return device, 0, f"device pool from {inputs.device_flag or 'GPU memory'}"
    wanted = AUTO_HOST_RATIO * device
    if budget is None:
        return device, wanted, "host pool twice the device pool (available memory unknown)"
    own = device * page if inputs.device_in_host_memory else 0
    host_max = (budget - own) // page
    if host_max >= wanted:
        return device, wanted, "host pool twice the device pool fits"
    if host_max > device:
        return device, host_max, f"host pool shrunk to fit {_gb(budget - own)}"
    if inputs.device_flag is not None:
        raise ConfigError(
            f"{inputs.device_flag} gives a device pool of {device} pages "
            f"({_gb(device * page)}), and the host pool must be larger: "
            f"{_figures(inputs, budget)}, so there is room for {max(host_max, 0)} host pages "
            f"only. Shrink the device pool, set --hicache-size explicitly, or turn the "
            f"host pool off (--disable-hierarchical-cache)"
        )
    # GPU memory by default: a smaller device pool rather than none.
    shrunk = host_max // AUTO_HOST_RATIO
    if shrunk < floor:
        raise ConfigError(_too_little(inputs, budget, floor * AUTO_HOST_RATIO * page, floor))
    return (shrunk, AUTO_HOST_RATIO * shrunk,
            f"device pool shrunk from {device} pages: the host pool must be larger and "
            f"{_gb(budget)} of host memory holds {host_max} pages")


def _too_little(inputs: SizingInputs, budget: int, need: int, floor: int) -> str:
    host = ", and a host pool twice that" if inputs.hierarchical else ""
    return (
        f"not enough memory for the KV pools: {_figures(inputs, budget)}; the smallest "
        f"pools that serve --max-running-requests {inputs.max_running_requests} "
        f"({MIN_PAGES_PER_REQUEST} device pages of {inputs.page_size} tokens per request: "
        f"{floor} pages{host}) need {_gb(need)}. Free memory, lower --max-running-requests, "
        f"or size the pools yourself (--max-total-tokens, --hicache-size; "
        f"--disable-hierarchical-cache drops the host pool)"
    )


def _figures(inputs: SizingInputs, budget: int) -> str:
    available = inputs.available
    assert available is not None
    ranks = f", shared by {inputs.tp_size} tensor-parallel ranks" if inputs.tp_size > 1 else ""
    return (
        f"{_gb(available.bytes)} is available ({available.source}{ranks}), of which an "
        f"eighth (at most 10 GiB) is left to the rest of the machine; this process holds "
        f"{_gb(inputs.resident_bytes)} (weights {_gb(inputs.weights_bytes)}) and keeps a "
        f"reserve of {_gb(inputs.reserve_bytes)}, which leaves {_gb(max(budget, 0))} for "
        f"the pools"
    )


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3f} GB"
