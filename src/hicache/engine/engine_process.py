"""The engine in a process of its own: the engine's side of the pipe to the server.

``hicache serve`` runs the HTTP server (event loop, request parsing, chat
templates, tokenization, SSE) in one process and the engine (scheduler, model,
cache controller, storage threads, the output thread's detokenizing) in another,
as SGLang splits its tokenizer manager from its scheduler. In one interpreter
they shared one lock: when the OS took the core from whichever thread held it,
every other thread waited, and on a machine whose cores were busy with other
work throughput collapsed (docs/benchmarks.md). Across the process boundary the
event loop never waits for the scheduler's Python work, nor the scheduler for
the event loop's.

The wire is one ``multiprocessing`` pipe, pickled tuples, each side's sends
under a lock:

- server -> engine: ``("generate", GenerateRequest)`` (rid set, validated),
  ``("abort", rid)``, ``("call", call_id, name, args)`` (a control method of
  ``Engine``, from ``CALLS``), ``("shutdown",)``;
- engine -> server: ``("ready", EngineInfo)`` or ``("start_failed", message)``
  once at start, then ``("outputs", [GenerateOutput, ...])`` once per step (the
  output thread's ``PipeSink``), ``("reply", call_id, ok, value or exception)``.

The engine process ends when told to, or as soon as its server is gone (killed,
even with SIGKILL): its pipe's end, or the parent-death signal and the parent
poll of ``engine.parent_death``, whichever comes first (the pipe is read only
between messages and after the build; the signal comes even while the engine is
being built). An orphaned engine first closes its KV event sockets (a server
started again at once binds the same ports), then shuts down in order within
``ORPHAN_EXIT_S`` (a store's client released, threads stopped), then ends with
``ORPHANED_EXIT_CODE`` whether or not that finished. One of the two ends runs,
never both: ``_Lifetime``. The server's side is ``hicache.engine.engine_client``.

Under tensor parallelism (``--tp-size N``) this process is rank 0 and N - 1 more
processes run ``run_follower_process``: each joins the group, builds its rank's
engine and follows rank 0's ticks (``hicache.engine.replication``) until rank 0
stops the group. The ranks agree whether every rank built its part
(``hicache.engine.start_agreement``): when one could not, rank 0 sends
``start_failed`` naming it and the followers exit with ``START_FAILED_EXIT_CODE``.
A failure of the group (a rank died) ends every rank's process with
``GROUP_FAILED_EXIT_CODE``; the server sees it and exits. A follower whose server
is gone ends at once with ``ORPHANED_EXIT_CODE`` (its main thread may be waiting in
a collective for a rank 0 that is ending too).

A rank's process exit codes, for whoever reads them (the server, an operator):

- 3 (``GROUP_FAILED_EXIT_CODE``): its tensor-parallel group failed (a rank died, or a
  tick raised), any rank;
- 4 (``START_FAILED_EXIT_CODE``): a follower rank, when the group could not start
  (its own failure or another rank's, which rank 0 reports);
- 5 (``ORPHANED_EXIT_CODE``): any rank, when its server died without stopping it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from multiprocessing.connection import Connection
from typing import Any

from hicache.engine.api import CachedTokens, GenerateOutput, GenerateRequest
from hicache.engine.config import EngineConfig
from hicache.engine.output_thread import Delivery, Stream
from hicache.engine.parent_death import follow_parent
from hicache.engine.start_agreement import RankStartError, describe
from hicache.storage.base import StorageError

logger = logging.getLogger(__name__)

# The Engine methods the server may call across the pipe (anything else is refused).
CALLS = frozenset({
    "flush_cache", "is_idle", "metrics", "storage_status", "attach_storage", "detach_storage",
    "clear_storage",
    "check_integrity", "evict_device_cache", "routing_info",
    "drain_l3_step", "l3_lacking_pages", "abort_all", "warm_start", "warm_step", "warm_stop",
    "apply_hints", "hint_status", "purge_tenant",
})
# What a failure to build the engine means for the user (bad flags, a file, memory, a
# rank that could not start), reported as a message rather than a traceback, as an
# in-process build does.
START_ERRORS = (ValueError, StorageError, OSError, MemoryError, RankStartError)
# A rank's process ends with this when its tensor-parallel group failed.
GROUP_FAILED_EXIT_CODE = 3
# A follower rank's process ends with this when the group could not start (its own
# failure or another rank's: rank 0 reports which).
START_FAILED_EXIT_CODE = 4
# A rank's process ends with this when its server died without stopping it.
ORPHANED_EXIT_CODE = 5
# How long an orphaned engine process may take to shut down in order before it ends anyway.
ORPHAN_EXIT_S = 5.0


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of the engine, fixed once it is built."""

    model_name: str
    vocab_size: int
    max_context_len: int
    chunked_prefill_size: int
    attention_backend: str
    device: str
    # The dir the server loads the same tokenizer from (None: the byte-level one), and
    # the end-of-sequence ids the engine's tokenizer has (the model's extras included).
    tokenizer_dir: str | None
    eos_token_ids: tuple[int, ...]
    routing_info: dict[str, Any] = field(default_factory=dict)


class PipeSink:
    """The output thread's sink in the engine process: a step's outputs in one send."""

    def __init__(self, send: Callable[[Any], None]) -> None:
        self._send = send

    def deliver(self, items: Delivery) -> None:
        self._send(("outputs", [output for _, output in items]))


def _set_up_process(log_level: int) -> None:
    # Ctrl-C, and a SIGTERM sent to the whole process group (timeout(1), a container's
    # stop), reach this process too: the server shuts the engine down in order, and the
    # pipe closing stops it if the server is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


class _Ended(Enum):
    """Why the engine's side of the pipe stopped serving."""

    SHUTDOWN = "shutdown"  # the server said so: it waits for the process to end
    PIPE_CLOSED = "pipe closed"  # the server is gone


def _exit_now(code: int) -> None:
    logging.shutdown()
    os._exit(code)


class _Lifetime:
    """How rank 0's process ends, once: an orderly shutdown the server asked for, or the
    end of an orphan (its server gone), whichever claims it first. The other one then
    waits for the process to end: two shutdowns of one engine must never run together."""

    def __init__(self) -> None:
        self._claim = threading.Lock()
        self.engine: Any = None  # set once built: before that an orphan has nothing to stop

    def claim(self) -> None:
        """The orderly end: returns when it is this thread's to run, else never."""
        if not self._claim.acquire(blocking=False):
            threading.Event().wait()  # the orphan's end runs, and ends the process

    def orphaned(self, reason: str) -> None:
        """The server is gone: release the ports, stop in order within ``ORPHAN_EXIT_S``,
        end the process. Never returns."""
        # Armed before anything else: whatever hangs below (or an orderly shutdown already
        # running, when the server died during it), the process ends in bounded time.
        watchdog = threading.Timer(ORPHAN_EXIT_S, _exit_now, args=(ORPHANED_EXIT_CODE,))
        watchdog.daemon = True
        watchdog.start()
        if not self._claim.acquire(blocking=False):
            threading.Event().wait()  # the orderly end runs, the watchdog bounds it
        logger.warning("%s: the engine process stops", reason)
        engine = self.engine
        if engine is not None:
            try:
                # The sockets a restarted server binds again, before anything slower.
                if engine.event_publisher is not None:
                    engine.event_publisher.close()
                engine.shutdown()
            except Exception:
                logger.exception("the orphaned engine did not shut down cleanly")
        _exit_now(ORPHANED_EXIT_CODE)


def _follower_orphaned(reason: str) -> None:
    logger.warning("%s: this tensor-parallel rank stops", reason)
    _exit_now(ORPHANED_EXIT_CODE)


def _join_group(config: EngineConfig, rank: int, init_method: str | None) -> Any:
    """This process's TPGroup (a single rank without tensor parallelism)."""
    from hicache.distributed.group import SINGLE_RANK, init_tp_group
    from hicache.engine.build import engine_device
    from hicache.model.loader import resolve_model_dir

    if not config.parallel.enabled:
        return SINGLE_RANK
    if init_method is None:
        raise ValueError("tensor parallelism needs the group's init method")
    device = engine_device(config, rank)
    if config.model.model_path is not None:
        # Converting a GGUF file may take minutes: done (by every rank at once, into
        # files of its own, renamed atomically) before the group's timeouts run.
        resolve_model_dir(config.model.model_path, config.model.dtype, device)
    return init_tp_group(rank, config.parallel.tp_size, init_method, device=device)


def _group_failed() -> None:
    """The tensor-parallel group failed: this rank's state may differ from the others',
    and they fail too. End the process now (threads and all), never hang."""
    logging.shutdown()
    os._exit(GROUP_FAILED_EXIT_CODE)


def run_engine_process(
    config: EngineConfig, conn: Connection, log_level: int,
    on_built: Callable[[Any], None] | None = None, tp_init_method: str | None = None,
    parent_pid: int | None = None,
) -> None:
    """The engine process's main: build the engine, serve the pipe until told to stop.

    ``on_built(engine)`` runs once the engine is built (``hicache serve`` logs its
    tiers there); it must be a module-level function (it is pickled by name).
    ``tp_init_method``: where the tensor-parallel group meets (with ``--tp-size`` > 1);
    this process is its rank 0. ``parent_pid``: the server's pid; the process ends
    when that is no longer its parent (None: only the pipe's end tells).
    """
    lifetime = _Lifetime()
    if parent_pid is not None:
        follow_parent(parent_pid, lifetime.orphaned)
    _set_up_process(log_level)
    from hicache.engine.build import build_engine  # torch and the model: in this process only

    try:
        tp = _join_group(config, 0, tp_init_method)
        engine = build_engine(config, tp, on_fatal=_group_failed)
    except START_ERRORS as error:
        conn.send(("start_failed", str(error)))
        return
    except BaseException as error:
        conn.send(("start_failed", f"{type(error).__name__}: {error}"))
        raise
    lifetime.engine = engine
    ended: _Ended | None = None  # None: an exception, raised on after the shutdown
    try:
        if on_built is not None:
            on_built(engine)
        ended = _EngineServer(engine, conn).serve()
    except (EOFError, OSError):  # the "ready" message found the pipe closed
        ended = _Ended.PIPE_CLOSED
    finally:
        if ended is _Ended.PIPE_CLOSED:
            lifetime.orphaned("the server closed the engine's pipe")
        lifetime.claim()
        engine.shutdown()
        conn.close()
        tp.destroy()


def run_follower_process(
    config: EngineConfig, rank: int, tp_init_method: str, log_level: int,
    start_report: Connection | None = None, parent_pid: int | None = None,
) -> None:
    """A tensor-parallel rank above 0: join the group, build this rank's engine, follow
    rank 0's ticks until it stops the group. Exits with ``GROUP_FAILED_EXIT_CODE`` when
    the group fails (rank 0 died), with ``START_FAILED_EXIT_CODE`` when the group could
    not start (every rank agrees on that, and rank 0 reports why). ``start_report``:
    where a start failure's message goes first, for the server to read when this
    process ended before the group could agree (it failed before joining it).
    ``parent_pid``: the server's pid; the process ends at once when that is no longer
    its parent."""
    if parent_pid is not None:
        follow_parent(parent_pid, _follower_orphaned)
    _set_up_process(log_level)
    from hicache.engine.build import build_engine

    try:
        tp = _join_group(config, rank, tp_init_method)
        engine = build_engine(config, tp, start=False)
    except Exception as error:
        logger.exception("tensor-parallel rank %d could not start", rank)
        if start_report is not None:
            message = str(error) if isinstance(error, RankStartError) else (
                f"tensor-parallel rank {rank} could not start: {describe(error)}"
            )
            with contextlib.suppress(OSError):
                start_report.send(message)
        # Whatever threads the failed build left, the process ends now.
        logging.shutdown()
        os._exit(START_FAILED_EXIT_CODE)
    if start_report is not None:
        start_report.close()
    logger.info("tensor-parallel rank %d of %d ready (pid %d)", rank, tp.size, os.getpid())
    try:
        engine.run_replica()
    except BaseException:
        logger.exception("tensor-parallel rank %d failed: ending its process", rank)
        _group_failed()
    engine.shutdown()
    tp.destroy()


class _EngineServer:
    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self._send_lock = threading.Lock()
        self.sink = PipeSink(self.send)
        # Control calls may wait for the scheduler thread (a flush, an attach that
        # connects to a store): never on the thread that takes in requests.
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-control")

    def send(self, message: Any) -> None:
        with self._send_lock:
            self.conn.send(message)

    def serve(self) -> _Ended:
        engine = self.engine
        tokenizer = engine.tokenizer
        self.send(("ready", EngineInfo(
            model_name=engine.model_name, vocab_size=engine.vocab_size,
            max_context_len=engine.max_context_len,
            chunked_prefill_size=engine.chunked_prefill_size,
            attention_backend=engine.attention_backend,
            device=engine.device,
            tokenizer_dir=engine.model_dir,
            eos_token_ids=tuple(tokenizer.eos_token_ids),
            routing_info=engine.routing_info(),
        )))
        try:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    return _Ended.PIPE_CLOSED
                kind = message[0]
                if kind == "generate":
                    self._generate(message[1])
                elif kind == "abort":
                    engine.abort(message[1])
                elif kind == "call":
                    self._calls.submit(self._call, *message[1:])
                elif kind == "shutdown":
                    return _Ended.SHUTDOWN
                else:
                    logger.error("the engine process got an unknown message %r", kind)
        finally:
            self._calls.shutdown(wait=True, cancel_futures=True)

    def _generate(self, request: GenerateRequest) -> None:
        try:
            self.engine.submit(request, Stream(self.sink))
        except Exception as error:  # validated by the server: only a broken engine gets here
            logger.exception("the engine could not take request %s", request.rid)
            self.send(("outputs", [GenerateOutput(
                rid=request.rid, token_ids=(), text="", finished=True, finish_reason="abort",
                prompt_tokens=len(request.input_ids), completion_tokens=0,
                cached_tokens=CachedTokens(), error=f"{type(error).__name__}: {error}",
            )]))

    def _call(self, call_id: int, name: str, args: tuple[Any, ...]) -> None:
        try:
            if name not in CALLS:
                raise ValueError(f"the engine process has no call {name!r}")
            value = getattr(self.engine, name)(*args)
            reply: tuple[Any, ...] = ("reply", call_id, True, value)
        except Exception as error:  # the server raises it where it called
            reply = ("reply", call_id, False, error)
        try:
            self.send(reply)
        except Exception as error:  # e.g. an exception that does not pickle
            self.send(("reply", call_id, False, RuntimeError(f"{type(error).__name__}: {error}")))

