"""The disaggregation flags, their config, and the request's bootstrap fields."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from hicache.config import ConfigError
from hicache.disaggregation.config import DisaggregationConfig, DisaggregationMode
from hicache.engine.api import Bootstrap, GenerateRequest, SamplingParams
from hicache.engine.config import EngineConfig, ParallelConfig
from hicache.server.bootstrap_fields import MAX_ROOM, request_bootstrap, sample_room
from hicache.server.choices import sample_requests
from hicache.server.engine_args import add_engine_args, engine_config_from_args
from hicache.server.errors import APIError


def _config(*flags: str, host: str = "127.0.0.1") -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--device", "cpu", *flags])
    args.host = host
    return engine_config_from_args(args)


def test_flags_make_the_config_with_sglang_defaults() -> None:
    assert _config().disaggregation == DisaggregationConfig()
    assert DisaggregationConfig().bootstrap_port == 8998
    pd = _config("--disaggregation-mode", "decode", "--disaggregation-transfer-timeout-s", "5",
                 "--disaggregation-decode-enable-offload-kvcache").disaggregation
    assert pd.mode is DisaggregationMode.DECODE and pd.transfer_timeout_s == 5
    assert pd.decode_offload_kvcache and pd.enabled
    # A wildcard bind address is no address for peers: the machine's own is used.
    assert _config("--disaggregation-mode", "prefill", host="0.0.0.0").disaggregation.host \
        not in ("0.0.0.0", "")


@pytest.mark.parametrize("kwargs, flag", [
    ({"decode_offload_kvcache": True, "mode": DisaggregationMode.PREFILL},
     "--disaggregation-decode-enable-offload-kvcache"),
    ({"bootstrap_port": 0}, "--disaggregation-bootstrap-port"),
    ({"transfer_timeout_s": 0}, "--disaggregation-transfer-timeout-s"),
])
def test_bad_settings_name_their_flag(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        DisaggregationConfig(**kwargs)


def test_tensor_parallel_disaggregation_is_refused() -> None:
    with pytest.raises(ConfigError, match="tp-size"):
        EngineConfig(parallel=ParallelConfig(tp_size=2),
                     disaggregation=DisaggregationConfig(mode=DisaggregationMode.PREFILL))


def _state(mode: str) -> Any:
    return SimpleNamespace(info=SimpleNamespace(server_args={"disaggregation_mode": mode}))


def test_bootstrap_fields_are_required_on_either_side_and_ignored_on_a_plain_server() -> None:
    assert request_bootstrap(_state("null"), "h", 1, 2) is None
    assert request_bootstrap(_state("null"), None, None, None) is None
    assert request_bootstrap(_state("decode"), "h", 1, 2**63 - 1) == Bootstrap("h", 1, 2**63 - 1)
    for mode in ("prefill", "decode"):
        with pytest.raises(APIError, match="bootstrap_room") as refused:
            request_bootstrap(_state(mode), "h", 1, None)
        assert refused.value.status == 400


@pytest.mark.parametrize("host, port, room", [
    ("", 1, 1), ("h", 0, 1), ("h", "80", 1), ("h", 1, -1), ("h", 1, 2**63), ("h", 1, True),
])
def test_malformed_bootstrap_fields_are_a_400(host: Any, port: Any, room: Any) -> None:
    with pytest.raises(APIError) as refused:
        request_bootstrap(_state("prefill"), host, port, room)
    assert refused.value.status == 400


def test_each_sample_gets_its_own_room_both_sides_agree_on() -> None:
    rooms = [sample_room(7, i) for i in range(4)]
    assert rooms[0] == 7 and len(set(rooms)) == 4
    assert rooms == [sample_room(7, i) for i in range(4)]  # the same on every instance
    assert all(0 <= r <= MAX_ROOM for r in rooms)
    # Adjacent request rooms (a router counting) do not share sample rooms.
    neighbours = {sample_room(r, i) for r in range(1000, 1100) for i in range(8)}
    assert len(neighbours) == 100 * 8


def test_samples_of_a_disaggregated_request_take_their_own_rooms() -> None:
    request = GenerateRequest((1, 2, 3), SamplingParams(seed=5), rid="r",
                              bootstrap=Bootstrap("h", 1, 99))
    samples = sample_requests(request, 3)
    assert [s.rid for s in samples] == ["r-0", "r-1", "r-2"]
    assert [s.bootstrap.room for s in samples if s.bootstrap] == [sample_room(99, i)
                                                                    for i in range(3)]
    assert [s.sampling.seed for s in samples] == [5, 6, 7]
    assert sample_requests(request, 1) == [request]
