"""The engine's running totals, which /metrics exports (``engine_<field>``).

Written only on the scheduler thread; read from others as plain ints and floats
(a read may see a step half-counted, never a torn value). Each request's arrival,
prompt, cached tokens and end are counted once, however often it is retracted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineCounters:
    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    # The same aborts by the phase each request was in: waiting ones cost no prefill,
    # so these show whether abandoned requests are dropped before any compute.
    num_aborted_waiting: int = 0
    num_aborted_prefill: int = 0
    num_aborted_decode: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_device_tokens: int = 0
    num_cached_host_tokens: int = 0
    num_cached_storage_tokens: int = 0
    num_retractions: int = 0
    num_steps: int = 0
    # Steps that computed prompt tokens: those tokens and the steps' wall time (decode
    # rows riding along included), whose ratio a router reads as this worker's prefill rate.
    num_prefill_step_tokens: int = 0
    prefill_step_seconds: float = 0.0
