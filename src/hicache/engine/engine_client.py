"""The server's side of an engine in a process of its own (``hicache.engine.engine_process``).

``EngineClient`` is what the HTTP server holds instead of an ``Engine``: the same
API (``EngineProtocol`` plus the tokenizer and what /get_server_info reports),
with requests and control calls sent down a pipe and each step's outputs read
back by one reader thread, which hands every event loop its share in one
callback. Requests are validated here, before anything is sent, so a bad one is
a 4xx without a round trip; the tokenizer is loaded here from the dir the engine
names, so tokenizing and chat templates run beside the event loop, never in the
engine's interpreter.

Every process it starts follows this one's life (``engine.parent_death``, told
this process's pid): killed, even with SIGKILL, this process takes them along.

If the engine process dies, every request in flight ends at once with an error
(finish reason ``abort``), later requests fail, control calls raise
``EngineDeadError``, and ``on_death`` is called (``hicache serve`` then exits
non-zero): the server never hangs on an engine that is gone.

Under tensor parallelism (``config.parallel.tp_size`` > 1) it starts one process
per rank: rank 0 is the engine process above, the others follow it
(``engine_process.run_follower_process``) over a torch.distributed group on
loopback. Any rank's death is the engine's death: a watcher thread waits on every
follower's sentinel and, when one exits unasked, ends rank 0 too, so the server
fails every request and exits as it does for rank 0 alone. A rank that cannot start
fails ``start()`` with its reason: rank 0 reports what the ranks agreed
(``engine.start_agreement``), and a follower that failed before the group formed
reports it down a one-way pipe of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any

from hicache.engine.api import (
    CachedTokens,
    GenerateOutput,
    GenerateRequest,
    Hint,
    HintOutcome,
    validate_request,
)
from hicache.engine.config import EngineConfig
from hicache.engine.engine_process import EngineInfo, run_engine_process, run_follower_process
from hicache.engine.grammar import Grammars
from hicache.engine.output_thread import put_all
from hicache.net import free_port
from hicache.tokenizer.base import Tokenizer
from hicache.tokenizer.load import load_tokenizer

logger = logging.getLogger(__name__)

# Control calls answer within this (a flush or an L3 attach waits for the scheduler).
CALL_TIMEOUT_S = 120.0
# Building the engine: loading (maybe converting) the weights, pinning the host pool.
START_TIMEOUT_S = 1800.0
SHUTDOWN_TIMEOUT_S = 30.0
# How long rank 0 may take to report why it failed once a follower failed to start.
FOLLOWER_GRACE_S = 2.0


class EngineStartError(RuntimeError):
    """The engine process could not build the engine; the message says why."""


class EngineDeadError(RuntimeError):
    """The engine process is gone (it crashed or was killed)."""


class _Stream:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[GenerateOutput]):
        self.loop = loop
        self.queue = queue


class EngineClient:
    """An engine running in a child process, behind the in-process engine's API."""

    def __init__(
        self, config: EngineConfig, *, on_built: Callable[[Any], None] | None = None,
        on_death: Callable[[int | None], None] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.config = config
        self.on_death = on_death
        self._on_built = on_built
        self._start_timeout_s = start_timeout_s
        self._process: Any = None  # multiprocessing's SpawnProcess
        # Tensor-parallel ranks 1.. (none without tensor parallelism), and why the engine
        # died when a follower's death ended it.
        self._followers: list[Any] = []
        # Each follower's start failure message, if it sends one (rank order, from rank 1).
        self._start_reports: list[Connection] = []
        self._death_cause: str | None = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._closing = False
        self.dead = False
        self.info: EngineInfo | None = None
        self.tokenizer: Tokenizer  # loaded by start(), from the dir the engine names

    # ------------------------------------------------------------ lifecycle
    def start(self) -> EngineClient:
        """Spawn the engine process and wait until its engine is built.

        Raises EngineStartError with the engine's own message when it cannot be built.
        """
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        ours, theirs = context.Pipe(duplex=True)
        level = logging.getLogger().getEffectiveLevel()
        tp_size = self.config.parallel.tp_size
        init_method = f"tcp://127.0.0.1:{free_port()}" if tp_size > 1 else None
        process = context.Process(
            target=run_engine_process, name="hicache-engine",
            args=(self.config, theirs, level, self._on_built, init_method),
            kwargs={"parent_pid": os.getpid()},
        )
        process.start()
        theirs.close()  # the child holds its end: its death is then our end's EOF
        self._process, self._conn = process, ours
        for rank in range(1, tp_size):
            report, report_end = context.Pipe(duplex=False)
            follower = context.Process(
                target=run_follower_process, name=f"hicache-engine-tp{rank}",
                args=(self.config, rank, init_method, level, report_end),
                kwargs={"parent_pid": os.getpid()},
            )
            follower.start()
            report_end.close()
            self._followers.append(follower)
            self._start_reports.append(report)
        try:
            message = self._first_message(ours)
        except BaseException:
            self._kill()
            raise
        finally:
            for report in self._start_reports:
                report.close()
        if message[0] != "ready":
            self._kill()
            raise EngineStartError(str(message[1]))
        info: EngineInfo = message[1]
        self.info = info
        self.tokenizer = load_tokenizer(info.tokenizer_dir, info.eos_token_ids)
        # Grammars are compiled here too, so that a bad one is a 400 before anything is
        # sent (the engine process compiles its own from the same tokenizer).
        self.grammars = Grammars(self.tokenizer, info.vocab_size)
        self._reader = threading.Thread(target=self._read, name="hicache-engine-reader",
                                        daemon=True)
        self._reader.start()
        if self._followers:
            threading.Thread(target=self._watch_followers, name="hicache-tp-watcher",
                             daemon=True).start()
            logger.info("engine processes ready: rank 0 %d, ranks 1.. %s", process.pid,
                        [p.pid for p in self._followers])
        else:
            logger.info("engine process %d ready", process.pid)
        return self

    def _first_message(self, conn: Connection) -> Any:
        deadline = time.monotonic() + self._start_timeout_s
        while not conn.poll(0.2):
            if not self._process.is_alive():
                raise EngineStartError(
                    f"the engine process exited while starting (exit code "
                    f"{self._process.exitcode}); its log above says why"
                )
            for rank, follower in enumerate(self._followers, start=1):
                # Rank 0 reports a failure the ranks agreed on (or one of its own): its
                # message, if it comes at once, names every rank that failed. Else the
                # follower failed before the group could agree: its own report says why.
                if not follower.is_alive() and not conn.poll(FOLLOWER_GRACE_S):
                    raise EngineStartError(self._follower_start_failure(rank, follower))
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"the engine was not ready within {self._start_timeout_s:.0f} s"
                )
        try:
            return conn.recv()
        except (EOFError, OSError):
            raise EngineStartError("the engine process exited while starting") from None

    def _follower_start_failure(self, rank: int, follower: Any) -> str:
        report = self._start_reports[rank - 1]
        try:
            if report.poll():
                return str(report.recv())
        except (EOFError, OSError):
            pass  # it died without a word (killed, or a crash)
        return (f"tensor-parallel rank {rank} exited while starting (exit code "
                f"{follower.exitcode}); its log above says why")

    def shutdown(self) -> None:
        """Stop the engine process (its engine shuts down in order), then the reader."""
        if self._process is None:
            return
        self._closing = True
        with contextlib.suppress(OSError, ValueError, EngineDeadError):
            self._send(("shutdown",))
        self._process.join(SHUTDOWN_TIMEOUT_S)
        if self._process.is_alive():
            logger.error("the engine process did not stop within %.0f s: killing it",
                         SHUTDOWN_TIMEOUT_S)
            self._kill()
        # Rank 0 stopped the group on its way out: the followers end by themselves.
        for follower in self._followers:
            follower.join(SHUTDOWN_TIMEOUT_S)
        self._kill()
        if self._reader is not None:
            self._reader.join(SHUTDOWN_TIMEOUT_S)
        if self._conn is not None:
            self._conn.close()
        self._process = None

    def _kill(self) -> None:
        """Kill every rank's process still alive."""
        for process in [self._process, *self._followers]:
            if process is not None and process.is_alive():
                process.kill()
                process.join(SHUTDOWN_TIMEOUT_S)

    def _watch_followers(self) -> None:
        """Until shutdown: a follower rank that exits ends rank 0 as well (its collectives
        would fail anyway; this does not wait for its next one), which fails every request
        and calls ``on_death``."""
        waiting = {follower.sentinel: rank
                   for rank, follower in enumerate(self._followers, start=1)}
        ended = wait(list(waiting))
        if self._closing or self.dead:
            return
        rank = waiting[ended[0]]
        follower = self._followers[rank - 1]
        follower.join(1.0)  # its sentinel is ready before its exit code is read
        code = follower.exitcode
        self._death_cause = f"tensor-parallel rank {rank} exited (exit code {code})"
        logger.error("%s: ending the engine", self._death_cause)
        process = self._process
        if process is not None and process.is_alive():
            process.kill()  # its pipe's EOF reaches the reader: _engine_gone

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # ------------------------------------------------------- what it is
    def _info(self) -> EngineInfo:
        if self.info is None:
            raise RuntimeError("the engine process is not started")
        return self.info

    @property
    def model_name(self) -> str:
        return self._info().model_name

    @property
    def vocab_size(self) -> int:
        return self._info().vocab_size

    @property
    def max_context_len(self) -> int:
        return self._info().max_context_len

    @property
    def chunked_prefill_size(self) -> int:
        return self._info().chunked_prefill_size

    @property
    def attention_backend(self) -> str:
        return self._info().attention_backend

    @property
    def device(self) -> str:
        return self._info().device

    def routing_info(self) -> dict[str, Any]:
        return dict(self._info().routing_info)

    # ------------------------------------------------------------ requests
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        validate_request(request, self.vocab_size, self.max_context_len)
        spec = request.sampling.grammar
        if spec is not None:  # off the event loop: the first one walks the vocabulary
            await asyncio.to_thread(self.grammars.compile, spec)
        if self.dead:
            raise EngineDeadError("the engine process is gone")
        rid = request.rid or uuid.uuid4().hex
        if not request.rid:
            request = dataclasses.replace(request, rid=rid)
        queue: asyncio.Queue[GenerateOutput] = asyncio.Queue()
        with self._streams_lock:
            self._streams[rid] = _Stream(asyncio.get_running_loop(), queue)
        finished = False
        try:
            self._send(("generate", request))
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            with self._streams_lock:
                self._streams.pop(rid, None)
            if not finished and not self.dead:  # the caller went away: free what it holds
                with contextlib.suppress(OSError, ValueError, EngineDeadError):
                    self._send(("abort", rid))

    def abort(self, rid: str) -> None:
        self._send(("abort", rid))

    # ------------------------------------------------------------- control
    def is_idle(self) -> bool:
        return bool(self._call("is_idle"))

    def flush_cache(self) -> bool:
        return bool(self._call("flush_cache"))

    def metrics(self) -> dict[str, float]:
        value: dict[str, float] = self._call("metrics")
        return value

    def storage_status(self) -> dict[str, Any]:
        value: dict[str, Any] = self._call("storage_status")
        return value

    def attach_storage(self, backend: str, extra_config: dict[str, Any], policy: str) -> None:
        self._call("attach_storage", backend, extra_config, policy)

    def detach_storage(self) -> None:
        self._call("detach_storage")

    def clear_storage(self) -> None:
        self._call("clear_storage")

    def check_integrity(self) -> None:
        self._call("check_integrity")

    def evict_device_cache(self) -> int:
        return int(self._call("evict_device_cache"))

    def drain_l3_step(self) -> dict[str, Any]:
        value: dict[str, Any] = self._call("drain_l3_step")
        return value

    def l3_lacking_pages(self) -> int:
        return int(self._call("l3_lacking_pages"))

    def warm_start(
        self, warm_id: str, items: list[list[int]], max_host_fraction: float
    ) -> dict[str, Any]:
        value: dict[str, Any] = self._call("warm_start", warm_id, items, max_host_fraction)
        return value

    def warm_step(self, warm_id: str) -> dict[str, Any]:
        value: dict[str, Any] = self._call("warm_step", warm_id)
        return value

    def warm_stop(self, warm_id: str) -> dict[str, Any]:
        value: dict[str, Any] = self._call("warm_stop", warm_id)
        return value

    def apply_hints(self, hints: list[Hint]) -> list[HintOutcome]:
        value: list[HintOutcome] = self._call("apply_hints", list(hints))
        return value

    def hint_status(self) -> dict[str, Any]:
        value: dict[str, Any] = self._call("hint_status")
        return value

    def abort_all(self, message: str) -> int:
        return int(self._call("abort_all", message))

    def purge_tenant(self, tenant: str | None, timeout_s: float) -> dict[str, Any]:
        value: dict[str, Any] = self._call("purge_tenant", tenant, timeout_s)
        return value

    def _call(self, name: str, *args: Any) -> Any:
        future: Future[Any] = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        try:
            self._send(("call", call_id, name, args))
            return future.result(timeout=CALL_TIMEOUT_S)
        finally:
            self._calls.pop(call_id, None)

    def _send(self, message: Any) -> None:
        if self.dead or self._conn is None:
            raise EngineDeadError("the engine process is gone")
        with self._send_lock:
            self._conn.send(message)

    # --------------------------------------------------------- the reader
    def _read(self) -> None:
        conn = self._conn
        assert conn is not None
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            try:
                if kind == "outputs":
                    self._dispatch(message[1])
                elif kind == "reply":
                    _, call_id, ok, value = message
                    future = self._calls.get(call_id)
                    if future is not None and not future.done():
                        if ok:
                            future.set_result(value)
                        else:
                            future.set_exception(value)
                else:
                    logger.error("unknown message %r from the engine process", kind)
            except Exception:  # never let the reader die: every stream would hang
                logger.exception("failed handling a message from the engine process")
        self._engine_gone()

    def _dispatch(self, outputs: list[GenerateOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, GenerateOutput]]] = {}
        with self._streams_lock:
            streams = self._streams
            for output in outputs:
                stream = streams.get(output.rid)
                if stream is None:
                    continue  # its caller went away
                by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that event loop is closed
                loop.call_soon_threadsafe(put_all, items)

    def _engine_gone(self) -> None:
        """The pipe closed: a shutdown we asked for, or the engine process died."""
        self.dead = True
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(EngineDeadError("the engine process is gone"))
        if self._closing:
            return
        process = self._process
        if process is not None:
            process.join(5.0)
        code = process.exitcode if process is not None else None
        for rank, follower in enumerate(self._followers, start=1):
            if self._death_cause is None and follower.exitcode not in (None, 0):
                self._death_cause = (
                    f"tensor-parallel rank {rank} exited (exit code {follower.exitcode})"
                )
        for follower in self._followers:  # the group cannot go on without rank 0
            if follower.is_alive():
                follower.kill()
        cause = self._death_cause or f"the engine process exited unexpectedly (exit code {code})"
        logger.error("%s: failing every request in flight", cause)
        with self._streams_lock:
            streams = dict(self._streams)
        for rid, stream in streams.items():
            ended = GenerateOutput(
                rid=rid, token_ids=(), text="", finished=True, finish_reason="abort",
                prompt_tokens=0, completion_tokens=0, cached_tokens=CachedTokens(),
                error=cause,
            )
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(put_all, [(stream.queue, ended)])
        if self.on_death is not None:
            self.on_death(code)
