"""What /get_model_info and /get_server_info say about this server, in SGLang's names.

SGLang's router reads ``model_path`` (then ``tokenizer_path``, ``is_generation``)
from the model info; tools read the server info as SGLang's server arguments
(``page_size``, ``enable_hierarchical_cache``, ``hicache_*`` ...) plus
``internal_states``. ``ServerInfo`` is fixed when the server starts
(``server_info_from_args``); what changes at run time (the attached L3 backend,
counters) is read when asked. The backend's extra config is shown without its
secrets: keys that name a password, token, key or credential, and passwords
inside URLs, are replaced by ``REDACTED``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from hicache.server.cost_model_info import cost_model_description
from hicache.storage.config import load_extra_config
from hicache.tokenizer.base import Tokenizer
from hicache.tokenizer.byte_level import ByteTokenizer
from hicache.tokenizer.byte_level_dir import byte_tokenizer_dir

logger = logging.getLogger(__name__)

REDACTED = "<redacted>"
_SECRET_KEY = re.compile(r"pass|secret|token|credential|auth|api_?key|access_?key|private",
                         re.IGNORECASE)

# Server arguments reported under SGLang's names, with this server's flag attribute.
_ARGS = {
    "model_path": "model_path",
    "load_format": "load_format",
    "dtype": "dtype",
    "device": "device",
    "tp_size": "tp_size",
    "context_length": "context_length",
    "page_size": "page_size",
    "max_running_requests": "max_running_requests",
    "chunked_prefill_size": "chunked_prefill_size",
    "max_total_tokens": "max_total_tokens",
    "mem_fraction_static": "mem_fraction_static",
    "disable_radix_cache": "disable_radix_cache",
    "enable_hierarchical_cache": "enable_hierarchical_cache",
    "hicache_ratio": "hicache_ratio",
    "hicache_size": "hicache_size",
    "hicache_write_policy": "hicache_write_policy",
    "hicache_io_backend": "hicache_io_backend",
    "hicache_mem_layout": "hicache_mem_layout",
    "hicache_storage_prefetch_policy": "hicache_storage_prefetch_policy",
    "hicache_reuse_policy": "hicache_reuse_policy",
    "hicache_pin_max_fraction": "hicache_pin_max_fraction",
    "hicache_pin_tenant_fraction": "hicache_pin_tenant_fraction",
    "hicache_hint_max_ttl_s": "hicache_hint_max_ttl_s",
    "hicache_retain_ttl_s": "hicache_retain_ttl_s",
    "disaggregation_mode": "disaggregation_mode",
    "disaggregation_transfer_backend": "disaggregation_transfer_backend",
    "disaggregation_bootstrap_port": "disaggregation_bootstrap_port",
    "disaggregation_decode_enable_offload_kvcache":
        "disaggregation_decode_enable_offload_kvcache",
}


# Flags whose None means "not given" (the pools are then sized from the machine's
# memory): reported with SGLang's defaults, which SGLang's tools expect; the memory
# block says what the pools came to.
_UNSET_AS = {"mem_fraction_static": 0.85, "hicache_ratio": 2.0, "hicache_size": 0}

# What a router reads beyond SGLang's arguments (Engine.routing_info).
ROUTING_KEYS = (
    "kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic",
    "hicache_l3_key_seed", "hicache_l3_object_order",
)


def public_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with secrets replaced by REDACTED (nested objects too)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if _SECRET_KEY.search(str(key)):
            out[key] = REDACTED
        elif isinstance(value, Mapping):
            out[key] = public_config(value)
        elif isinstance(value, str):
            out[key] = _url_without_password(value)
        else:
            out[key] = value
    return out


def _url_without_password(text: str) -> str:
    if "@" not in text or "://" not in text:
        return text
    parts = urlsplit(text)
    if parts.password is None:
        return text
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port is not None else ""
    netloc = f"{parts.username}:{REDACTED}@{host}{port}"
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass(frozen=True)
class ServerInfo:
    """The server as started: names, and the flags that shaped it (SGLang's names)."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    server_args: Mapping[str, Any] = field(default_factory=dict)
    # The L3 backend's extra config as started (secrets removed); the admin API replaces it.
    storage_config: Mapping[str, Any] = field(default_factory=dict)
    # --kv-events-config as given (SGLang reports its flag as the JSON string).
    kv_events_config: str | None = None


def server_info_from_args(
    args: argparse.Namespace, tokenizer_path: str | None = None
) -> ServerInfo:
    """``tokenizer_path``: what ``client_tokenizer_path`` found (default: --model-path).

    Without --model-path (dummy weights of a preset, serve's default model) the
    model path reported is the tokenizer dir: SGLang's router takes the tokenizer
    from /server_info's ``model_path`` alone, and would otherwise look the served
    name up on the Hugging Face hub.
    """
    model_path = getattr(args, "model_path", None) or tokenizer_path
    server_args = {name: getattr(args, attr) for name, attr in _ARGS.items()
                   if hasattr(args, attr)}
    for name, default in _UNSET_AS.items():
        if name in server_args and server_args[name] is None:
            server_args[name] = default
    extra = getattr(args, "hicache_storage_backend_extra_config", None)
    storage = public_config(load_extra_config(extra)) if extra else {}
    return ServerInfo(
        model_path=model_path, tokenizer_path=tokenizer_path or model_path,
        server_args=server_args, storage_config=storage,
        kv_events_config=getattr(args, "kv_events_config", None),
    )


def client_tokenizer_path(
    model_path: str | None, tokenizer: Tokenizer, dtype: str | None, device: str
) -> str | None:
    """A dir from which transformers' ``AutoTokenizer`` loads the served model's tokenizer.

    SGLang's clients (``bench_serving`` without ``--tokenizer``, the router) load it
    from ``/model_info``'s ``tokenizer_path``. A model dir is its own; a GGUF file
    (which AutoTokenizer cannot open by path) has its converted dir in the local
    cache; a model served with the byte-level tokenizer (dummy weights) gets that
    tokenizer written out as files. None when no such dir can be had.
    """
    # Imported here: model loading needs torch, and the router, which never imports torch
    # (tests/e2e/test_router_imports.py), imports this module for the public config.
    from hicache.model.loader import resolve_model_dir

    try:
        if isinstance(tokenizer, ByteTokenizer):
            return str(byte_tokenizer_dir())
        if model_path is None:
            return None
        # The conversion of a GGUF file exists by now (the engine loaded it): found, not redone.
        return str(resolve_model_dir(model_path, dtype, device).path)
    except OSError as error:
        logger.warning("no tokenizer dir for clients (/model_info tokenizer_path): %s", error)
        return None


def model_info(info: ServerInfo, served_model_name: str, weights_name: str) -> dict[str, Any]:
    """/get_model_info: what SGLang's router reads to name the worker's model."""
    return {
        "model_path": info.model_path if info.model_path is not None else weights_name,
        "tokenizer_path": info.tokenizer_path,
        "is_generation": True,
        "served_model_name": served_model_name,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


def l3_description(
    status: Mapping[str, Any], storage_config: Mapping[str, Any]
) -> dict[str, Any]:
    """The L3 tier now: attached or not, which backend, its policy and public config."""
    attached = bool(status.get("attached"))
    return {
        "attached": attached,
        "backend": status.get("backend") if attached else None,
        "prefetch_policy": status.get("prefetch_policy"),
        "prefetch_threshold": status.get("prefetch_threshold"),
        "config": dict(storage_config) if attached else {},
        "error": status.get("error"),
    }


def memory_description(counters: Mapping[str, float]) -> dict[str, Any] | None:
    """How the KV pools were sized, from the engine's ``memory_*`` numbers: ``source``
    "auto" when a pool was sized from the memory the machine could spare, else "flags";
    the figures it was sized from and the pools in bytes and tokens. None from an engine
    that does not say."""
    if "memory_announced_bytes" not in counters:
        return None

    def whole(key: str) -> int | None:
        value = counters.get(key)
        return int(value) if value is not None else None

    def source(key: str) -> str:
        return "auto" if counters.get(key) else "flags"

    return {
        "source": "auto" if counters.get("memory_auto_sized") else "flags",
        "device_pool_source": source("memory_device_pool_auto"),
        "host_pool_source": source("memory_host_pool_auto"),
        "available_bytes": whole("memory_available_bytes"),
        "resident_at_sizing_bytes": whole("memory_resident_at_sizing_bytes"),
        "weights_bytes": whole("memory_weights_bytes"),
        "reserve_bytes": whole("memory_reserve_bytes"),
        "device_pool_bytes": whole("memory_device_pool_bytes"),
        "device_pool_tokens": whole("memory_device_pool_tokens"),
        "device_pool_in_host_memory": bool(counters.get("memory_device_pool_in_host_memory")),
        "host_pool_bytes": whole("memory_host_pool_bytes"),
        "host_pool_pages": whole("host_pool_pages"),
        # What the engine process should stay within: resident at sizing + reserve +
        # the pools that are host memory; and what it holds now.
        "announced_bytes": whole("memory_announced_bytes"),
        "resident_bytes": whole("memory_resident_bytes"),
    }


def server_info(
    info: ServerInfo, served_model_name: str, l3: Mapping[str, Any],
    limits: Mapping[str, Any], counters: Mapping[str, float], version: str,
    routing: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """/get_server_info: SGLang's flat server arguments, then the live state.

    ``routing``: the engine's ``routing_info`` (event endpoints, L3 naming);
    its keys read None for engines that do not say.
    """
    extra = l3["config"]
    return {
        **info.server_args,
        "model_path": info.model_path,
        "tokenizer_path": info.tokenizer_path,
        "served_model_name": served_model_name,
        **limits,
        "hicache_storage_backend": l3["backend"],
        # A JSON string, as SGLang's flag is.
        "hicache_storage_backend_extra_config": json.dumps(extra) if extra else None,
        "kv_events_config": info.kv_events_config,
        **{key: None for key in ROUTING_KEYS},
        **(routing or {}),
        "l3": dict(l3),
        "memory": memory_description(counters),
        "cost_model": cost_model_description(counters),
        "internal_states": [dict(counters)],
        "version": version,
    }
