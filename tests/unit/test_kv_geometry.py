"""KV geometry (MHA/GQA: K and V per layer; MLA: one latent per layer) and the pools over it.

The MHA golden values below were produced before MLA existed: page keys and L3
frames of MHA models must stay byte-identical, or every page already in a
shared L3 would turn into a miss.
"""

from __future__ import annotations

import pytest
import torch

from hicache.config import ConfigError, MemLayout
from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import DEEPSEEK_V2_LITE, LLAMA3_8B, TINY, KVGeometry
from hicache.memory.host_pool import HostPool
from hicache.radix.keys import KeyNamespace
from hicache.storage.frame import PayloadOrder, encode_header

MHA = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32)
MLA = KVGeometry.mla(num_layers=3, latent_dim=10, dtype=torch.float32)
GEOMETRIES = pytest.mark.parametrize("geometry", [MHA, MLA], ids=["mha", "mla"])


def test_mla_is_one_plane_of_one_latent() -> None:
    assert (MLA.kv_planes, MLA.num_kv_heads, MLA.head_dim, MLA.row_elems) == (1, 1, 10, 10)
    assert MLA.is_mla and not MHA.is_mla
    assert MLA.bytes_per_token == 3 * 1 * 10 * 4
    assert MHA.bytes_per_token == 3 * 2 * 8 * 4
    # DeepSeek-V2-Lite: 27 layers x (512 + 64) bf16 per token.
    assert DEEPSEEK_V2_LITE.bytes_per_token == 27 * 576 * 2
    assert DEEPSEEK_V2_LITE.describe() == "MLA-L27-D576-bfloat16"


def test_mha_keys_and_frames_are_unchanged() -> None:
    assert LLAMA3_8B.kv_planes == 2
    assert LLAMA3_8B.describe() == "L32-H8-D128-bfloat16"
    assert LLAMA3_8B.page_bytes(16) == 2097152 and TINY.bytes_per_token == 1024
    namespace = KeyNamespace("m", LLAMA3_8B.describe(), 16, tp_rank=1, tp_size=2)
    assert namespace.seed().hex() == "bcf230a9136533bf1c4546f75d996400"
    assert namespace.seed("salt").hex() == "9586a863508dd68c0a724692736025a4"
    header = encode_header(
        bytes(range(16)), PayloadOrder.TOKEN_MAJOR, LLAMA3_8B.page_bytes(16), bytes(16)
    )
    assert header.hex() == (
        "48434b56010230000000200000000000000102030405060708090a0b0c0d0e0f"
        "00000000000000000000000000000000"
    )


def test_mla_and_mha_never_share_a_namespace() -> None:
    # The same numbers as an MHA geometry with one head: a different text, so different keys.
    one_head = KVGeometry(num_layers=3, num_kv_heads=1, head_dim=10, dtype=torch.float32)
    assert one_head.describe() != MLA.describe()
    seeds = {KeyNamespace("m", g.describe(), 4).seed() for g in (one_head, MLA)}
    assert len(seeds) == 2


def test_bad_geometries_are_refused() -> None:
    with pytest.raises(ConfigError, match="kv_planes"):
        KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, kv_planes=3)
    with pytest.raises(ConfigError, match="num_kv_heads must be 1"):
        KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, kv_planes=1)
    with pytest.raises(ConfigError, match="head_dim"):
        KVGeometry.mla(num_layers=2, latent_dim=0)


def test_device_pool_exposes_the_latent_and_no_v() -> None:
    pool = DevicePool(MLA, num_pages=4, page_size=2)
    assert pool.kv.shape == (3, 1, 8, 1, 10)
    latent = pool.latent_buffer(1)
    assert latent.shape == (8, 1, 10)
    assert latent.data_ptr() == pool.k_buffer(1).data_ptr()
    latent[5] = 7.0
    # Slot 5 is page 2, token 1: the canonical page view sees the write.
    assert bool((pool.pages[2, 1, 0, 1] == 7.0).all())
    assert int(torch.count_nonzero(pool.flat)) == 10
    with pytest.raises(ConfigError, match="latent_buffer"):
        pool.v_buffer(0)
    with pytest.raises(ConfigError, match="k_buffer / v_buffer"):
        DevicePool(MHA, num_pages=4, page_size=2).latent_buffer(0)


def test_mha_device_pool_keeps_k_and_v() -> None:
    pool = DevicePool(MHA, num_pages=4, page_size=2)
    assert pool.kv.shape == (3, 2, 8, 2, 4)
    pool.v_buffer(2)[3] = 1.0
    assert bool((pool.pages[1, 2, 1, 1] == 1.0).all())
    assert bool((pool.pages[1, 2, 0] == 0.0).all())


@GEOMETRIES
@pytest.mark.parametrize("layout", list(MemLayout))
def test_every_layout_covers_its_buffer_exactly_once(
    geometry: KVGeometry, layout: MemLayout
) -> None:
    pages, page_size = 5, 4
    host = HostPool(geometry, pages, page_size, layout, pin_memory=False)
    assert host.flat.numel() == pages * geometry.page_bytes(page_size) // geometry.element_bytes
    assert host.pages.shape == (pages, 3, geometry.kv_planes, page_size, geometry.row_elems)
    host.flat.copy_(torch.arange(host.flat.numel(), dtype=torch.float32))
    seen = host.pages.reshape(-1).sort().values
    assert torch.equal(seen, torch.arange(host.flat.numel(), dtype=torch.float32))


@GEOMETRIES
@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST, MemLayout.PAGE_FIRST_DIRECT])
def test_a_page_span_is_the_page_in_payload_order(geometry: KVGeometry, layout: MemLayout) -> None:
    host = HostPool(geometry, 3, 4, layout, pin_memory=False)
    host.flat.copy_(torch.arange(host.flat.numel(), dtype=torch.float32))
    page = host.pages[1]  # [layers, planes, page_size, row]
    if layout is MemLayout.PAGE_FIRST:
        page = page.permute(2, 0, 1, 3)  # token-major: [page_size, layers, planes, row]
    assert torch.equal(host.page_span(1), page.reshape(-1))


def test_one_layer_mla_layer_first_pages_are_contiguous() -> None:
    # [1 layer][1 plane][slots][row]: a page is page_size consecutive rows.
    geometry = KVGeometry.mla(num_layers=1, latent_dim=8, dtype=torch.float32)
    host = HostPool(geometry, 3, 4, MemLayout.LAYER_FIRST, pin_memory=False)
    host.flat.copy_(torch.arange(host.flat.numel(), dtype=torch.float32))
    assert host.strides.page_contiguous
    assert torch.equal(host.page_span(2), host.pages[2].reshape(-1))
