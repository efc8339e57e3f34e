"""A whole hicache cluster in child processes on loopback: workers, shared L3, the router.

``with Cluster(ClusterConfig(run_dir, ...)) as cluster:`` starts, each on free
127.0.0.1 ports:

- a ``mooncake_master`` when the L3 is Mooncake (the workers' shared store);
- ``num_workers`` ``hicache serve`` workers, all on one L3 (the ``file`` backend
  on one directory by default, or Mooncake through that master), each with
  private L1 and L2 sized by ``max_total_tokens`` and ``hicache_ratio`` /
  ``hicache_size_gb``, and each publishing its KV events on ports of its own;
- ``hicache router`` in front of them, when ``router`` is given.

With ``pd_decode_workers = N`` the cluster is prefill-decode disaggregated: the
last N workers run ``--disaggregation-mode decode``, the others
``--disaggregation-mode prefill`` (each with a bootstrap port of its own), and
the router runs ``--pd-disaggregation --prefill URL PORT ... --decode URL ...``.

Workers are launched side by side and then awaited; the router starts once
every worker answers /health, since it asks each for /get_server_info at
start-up. Leaving the block stops everything (router, workers, master), also
when starting failed halfway: each server runs in a process group of its own
and the whole group is ended (``ChildServer``). Logs stay in ``run_dir``:
``worker-<i>.log``, ``router.log``, ``mooncake-master.log``.

Tests kill parts on purpose (``Worker.kill``, ``Cluster.kill_master``) to watch
the rest cope.

The Mooncake client in each worker listens on every interface; the test suite
runs inside a private network namespace (tests/network_namespace.py), which
the children inherit. Elsewhere the cluster runs on the machine's network.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from hicache.local_cache import CACHE_DIR_ENV
from hicache.net import free_port
from hicache.testing.cpu_limit import CpuLimit
from hicache.testing.server_process import ChildServer, ServerProcess

if TYPE_CHECKING:  # imported where Mooncake is used: the module needs nothing of it otherwise
    from hicache.testing.mooncake_master import MasterProcess

KV_EVENTS_FLAG = "--kv-events-config"
KV_EVENTS_TOPIC = "kv-events"
_EXTRA_CONFIG_FLAG = "--hicache-storage-backend-extra-config"
# What router_args may name; filled in once the master runs.
MASTER_ADDRESS_FIELD = "{master_address}"


class L3Kind(str, enum.Enum):
    NONE = "none"  # no shared tier: each worker has only its L1 and L2
    FILE = "file"  # one directory every worker reads and writes
    MOONCAKE = "mooncake"  # a Mooncake Store behind a master the cluster starts


class ClusterError(RuntimeError):
    """The cluster cannot start as configured (the message says which part and why)."""


@dataclass(frozen=True)
class RouterConfig:
    """``hicache router`` in front of the workers."""

    policy: str = "tier_aware"
    # More router flags (--shared-cache-type hicache, --overlap-weight 2, ...);
    # "{master_address}" in them becomes the Mooncake master's host:port.
    args: tuple[str, ...] = ()
    # Replaces ``python -m hicache ... router`` (a stand-in router); the flags stay.
    program: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ClusterConfig:
    run_dir: Path  # logs, each worker's cache directory, the file L3
    num_workers: int = 3
    # Flags for every worker (model, device, page size, ...); the cluster adds
    # host, port, pool sizes, the L3 and the events config.
    worker_args: tuple[str, ...] = ()
    max_total_tokens: int | None = None  # each worker's device pool (L1); None: serve's default
    hicache_ratio: float | None = None  # each worker's host pool (L2) as a multiple of L1
    hicache_size_gb: float | None = None  # ... or in GB (wins over the ratio)
    l3: L3Kind = L3Kind.FILE
    l3_extra: Mapping[str, Any] = field(default_factory=dict)  # more backend extra config
    kv_events: bool = True  # each worker publishes KV events (--kv-events-config)
    router: RouterConfig | None = field(default_factory=RouterConfig)
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 20.0
    cpu_limit: CpuLimit | None = None  # pins every worker and the router (testing/cpu_limit.py)
    # Prefill-decode disaggregation: how many of the workers (the last ones) decode; 0: none
    # (every worker is an ordinary one).
    pd_decode_workers: int = 0
    pd_transfer_backend: str = "mooncake"
    # Decode workers back their finished requests' KV up to the L3 (the next turn's
    # prefill finds it there).
    pd_decode_offload: bool = False
    # The workers' HICACHE_CACHE_DIR (converted models, weight digests); None: this
    # process's, so a model converted once is not converted again for every cluster.
    cache_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ClusterError(f"a cluster needs at least one worker, not {self.num_workers}")
        if self.pd_decode_workers and not 0 < self.pd_decode_workers < self.num_workers:
            raise ClusterError(
                f"a disaggregated cluster needs at least one prefill and one decode worker: "
                f"{self.pd_decode_workers} decode of {self.num_workers} workers")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ClusterError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if self.hicache_ratio is not None and not self.hicache_ratio > 1:
            raise ClusterError(f"hicache_ratio must be > 1, got {self.hicache_ratio}")
        if self.hicache_size_gb is not None and not self.hicache_size_gb > 0:
            raise ClusterError(f"hicache_size_gb must be > 0, got {self.hicache_size_gb}")


@dataclass(frozen=True)
class EventEndpoints:
    """Where one worker publishes its KV events, as its --kv-events-config says."""

    endpoint: str  # ZMQ PUB
    replay_endpoint: str  # ZMQ ROUTER answering replay requests
    topic: str = KV_EVENTS_TOPIC

    def config_json(self) -> str:
        return json.dumps({
            "publisher": "zmq", "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint, "topic": self.topic,
        })


class Worker:
    """One ``hicache serve`` of the cluster."""

    def __init__(
        self, index: int, server: ServerProcess, events: EventEndpoints | None,
        mode: str = "null", bootstrap_port: int | None = None,
    ) -> None:
        self.index = index
        self.server = server
        self.events = events
        self.mode = mode  # its --disaggregation-mode: null, prefill or decode
        self.bootstrap_port = bootstrap_port  # a prefill worker's

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def log_path(self) -> Path:
        return self.server.log_path

    @property
    def running(self) -> bool:
        return self.server.running

    def kill(self) -> None:
        """SIGKILL the worker's whole process group, as a crash would."""
        self.server.kill()

    def stop(self) -> None:
        self.server.stop()

    def __repr__(self) -> str:
        return f"Worker({self.index}, {self.url})"


def serve_supports_kv_events() -> bool:
    """Does this ``hicache serve`` take --kv-events-config?"""
    from hicache.server.serve import add_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return KV_EVENTS_FLAG in parser._option_string_actions


def hicache_commands() -> frozenset[str]:
    """The subcommands this ``hicache`` has (serve, demo, bench, router once it exists)."""
    from hicache.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return frozenset(action.choices)
    return frozenset()


def router_available() -> bool:
    return "router" in hicache_commands()


def _hicache_program(command: str) -> list[str]:
    return [sys.executable, "-m", "hicache", "--log-level", "info", command]


class Cluster:
    """See the module docstring."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.run_dir = config.run_dir
        self.workers: list[Worker] = []
        self.router: ChildServer | None = None
        self.master: MasterProcess | None = None
        self.l3_path: Path | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Master, then every worker side by side, then the router; all stopped again
        when any part fails to come up."""
        config = self.config
        if self.workers:
            raise ClusterError("this cluster was started already; make a new Cluster")
        if config.kv_events and not serve_supports_kv_events():
            raise ClusterError(
                f"hicache serve has no {KV_EVENTS_FLAG} here, so workers cannot publish KV "
                "events: start the cluster with kv_events=False"
            )
        if config.router is not None and config.router.program is None and not router_available():
            raise ClusterError("hicache has no `router` command here, so no router can start")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            l3_args = self._start_l3()
            for index in range(config.num_workers):
                self.workers.append(self._make_worker(index, l3_args))
            for worker in self.workers:
                worker.server.launch()
            for worker in self.workers:
                worker.server.wait_ready()
            if config.router is not None:
                self._start_router(config.router)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Router first (no new requests reach dying workers), then workers, then the
        master; idempotent."""
        if self.router is not None:
            self.router.stop()
        # All told first, then each awaited: workers shut down side by side.
        for worker in self.workers:
            worker.server.terminate()
        for worker in self.workers:
            worker.stop()
        if self.master is not None:
            self.master.stop()

    # ------------------------------------------------------------------ parts
    def _start_l3(self) -> list[str]:
        """Start what the L3 needs; the worker flags that attach it."""
        config = self.config
        if config.l3 is L3Kind.NONE:
            return ["--hicache-storage-backend", "none"]
        if config.l3 is L3Kind.FILE:
            self.l3_path = self.run_dir / "l3"
            extra = {**config.l3_extra, "path": str(self.l3_path)}
            return ["--hicache-storage-backend", "file", _EXTRA_CONFIG_FLAG, json.dumps(extra)]
        from hicache.testing.mooncake_master import MasterError, start_master

        try:
            self.master = start_master(log_path=self.run_dir / "mooncake-master.log")
        except MasterError as error:
            raise ClusterError(f"the Mooncake master did not start: {error}") from error
        extra = {**config.l3_extra, "master_server_address": self.master.address}
        return ["--hicache-storage-backend", "mooncake", _EXTRA_CONFIG_FLAG, json.dumps(extra)]

    def _make_worker(self, index: int, l3_args: Sequence[str]) -> Worker:
        config = self.config
        flags = list(config.worker_args)
        if config.max_total_tokens is not None:
            flags += ["--max-total-tokens", str(config.max_total_tokens)]
        if config.hicache_size_gb is not None:
            flags += ["--hicache-size", f"{config.hicache_size_gb:g}"]
        elif config.hicache_ratio is not None:
            flags += ["--hicache-ratio", f"{config.hicache_ratio:g}"]
        flags += l3_args
        mode, bootstrap_port = self._pd_role(index)
        if mode != "null":
            flags += ["--disaggregation-mode", mode,
                      "--disaggregation-transfer-backend", config.pd_transfer_backend]
        if bootstrap_port is not None:
            flags += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        if mode == "decode" and config.pd_decode_offload:
            flags += ["--disaggregation-decode-enable-offload-kvcache"]
        events: EventEndpoints | None = None
        if config.kv_events:
            events = EventEndpoints(
                f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            )
            flags += [KV_EVENTS_FLAG, events.config_json()]
        env = dict(os.environ)
        if config.cache_dir is not None:
            env[CACHE_DIR_ENV] = str(config.cache_dir)
        server = ServerProcess(
            flags, self.run_dir / f"worker-{index}.log", env=env,
            startup_timeout_s=config.startup_timeout_s, stop_timeout_s=config.stop_timeout_s,
            cpu_limit=config.cpu_limit,
            name=f"worker {index}" if mode == "null" else f"{mode} worker {index}",
        )
        return Worker(index, server, events, mode, bootstrap_port)

    def _pd_role(self, index: int) -> tuple[str, int | None]:
        """Worker ``index``'s disaggregation mode and, for a prefill one, a free bootstrap
        port."""
        config = self.config
        if not config.pd_decode_workers:
            return "null", None
        if index >= config.num_workers - config.pd_decode_workers:
            return "decode", None
        return "prefill", free_port()

    def router_args(self, router: RouterConfig) -> list[str]:
        """The router's flags after ``--port``: workers, policy, then the caller's."""
        master = self.master.address if self.master is not None else None
        extra = []
        for arg in router.args:
            if MASTER_ADDRESS_FIELD in arg:
                if master is None:
                    raise ClusterError(
                        f"router flag {arg!r} names the Mooncake master, but this cluster's "
                        f"L3 is {self.config.l3.value}"
                    )
                arg = arg.replace(MASTER_ADDRESS_FIELD, master)
            extra.append(arg)
        if self.config.pd_decode_workers:
            pools: list[str] = ["--pd-disaggregation"]
            for worker in self.workers:
                if worker.mode == "prefill":
                    pools += ["--prefill", worker.url, str(worker.bootstrap_port)]
                else:
                    pools += ["--decode", worker.url]
            return [*pools, "--policy", router.policy, *extra]
        return [
            "--worker-urls", *(w.url for w in self.workers), "--policy", router.policy, *extra,
        ]

    def _start_router(self, router: RouterConfig) -> None:
        port = free_port()
        program = list(router.program) if router.program else _hicache_program("router")
        command = [*program, "--host", "127.0.0.1", "--port", str(port), *self.router_args(router)]
        self.router = ChildServer(
            command, port, self.run_dir / "router.log",
            startup_timeout_s=self.config.startup_timeout_s,
            stop_timeout_s=self.config.stop_timeout_s, ready_paths=("/health",),
            name="the router", cpu_limit=self.config.cpu_limit,
        )
        self.router.start()

    # ------------------------------------------------------------------ use
    @property
    def url(self) -> str:
        """Where clients go: the router's URL."""
        if self.router is None:
            raise ClusterError("this cluster has no router; talk to cluster.workers[i].url")
        return self.router.url

    def worker_urls(self) -> list[str]:
        return [w.url for w in self.workers]

    def kill_master(self) -> None:
        """SIGKILL the Mooncake master, as a crash would (``master.restart()`` brings it back)."""
        if self.master is None:
            raise ClusterError(f"this cluster's L3 is {self.config.l3.value}: it has no master")
        self.master.kill()

    def process_groups(self) -> list[int]:
        """The process group ids of the cluster's servers that were started (for checks
        that nothing outlives the cluster)."""
        servers: list[ChildServer] = [w.server for w in self.workers]
        if self.router is not None:
            servers.append(self.router)
        return [s.process.pid for s in servers if s.process is not None]

    def all_healthy(self, timeout_s: float = 5.0) -> bool:
        """Does every running worker (and the router) answer /health with 200?"""
        urls = [w.url for w in self.workers if w.running]
        if self.router is not None:
            urls.append(self.router.url)
        return all(_get_status(f"{url}/health", timeout_s) == 200 for url in urls)


def _get_status(url: str, timeout_s: float) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError):
        return None


def wait_for(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll ``condition()`` until it is true; False if it never was within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True
