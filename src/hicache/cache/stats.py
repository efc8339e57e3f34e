"""Counters of what the cache did; read by the demo, the server's /metrics and benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class CacheStats:
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_device_hit_tokens: int = 0
    num_host_hit_tokens: int = 0
    num_loaded_pages: int = 0
    num_backed_up_pages: int = 0
    num_backup_skipped_pages: int = 0
    # Of those, copied to the host later, at a next insert (room had come back meanwhile).
    num_backup_late_pages: int = 0
    num_device_evicted_pages: int = 0
    num_host_evicted_pages: int = 0
    # Of those, evicted because their tenant was at its host quota (its own pages).
    num_host_quota_evicted_pages: int = 0
    # L3: tokens a prefetch put into the tree, pages written to L3 by backups.
    num_storage_hit_tokens: int = 0
    num_storage_backed_up_pages: int = 0
    # Pages read from L3 that failed their payload check when loaded to the device.
    num_corrupt_pages: int = 0

    def record_hit(self, num_prompt_tokens: int, device_tokens: int, host_tokens: int) -> None:
        self.num_requests += 1
        self.num_prompt_tokens += num_prompt_tokens
        self.num_device_hit_tokens += device_tokens
        self.num_host_hit_tokens += host_tokens

    @property
    def hit_rate(self) -> float:
        hits = self.num_device_hit_tokens + self.num_host_hit_tokens
        return hits / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "hit_rate": self.hit_rate}
