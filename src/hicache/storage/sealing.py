"""Sealing L3 pages: AES-256-GCM per tenant, under the keys of ``--l3-encryption-keys``.

With a key file, every page a backend writes is sealed and every page it reads is
opened, at the one place the backend encodes or checks its frame (``PageRegions``
does it for them: ``frame``, ``check_landed``). The tenant is the one the storage
controller runs the call for (``call_tenant.current_tenant``); the key ring
(``tenancy.keys``) gives its write key and the keys it may read.

A sealed page (``frame``: format version 2) is the payload's ciphertext, the same
length as the payload, followed by a 64-byte header holding the GCM tag (in place
of the checksum), a random 96-bit nonce and the key id. The associated data is the
header without its tag: the page key, row order and length are authenticated
along with the payload.

Invariants:
- Nothing is written in plaintext: a tenant without a key has its pages refused
  (``seal`` answers None, the backend counts "no_key" and stores nothing).
- A page opens only under the key its header names, for the tenant of the call
  reading it; a key id the ring has not for that tenant is ``UNKNOWN_KEY``, a tag
  that fails (damage, a page moved to another name, another secret) is ``BAD_TAG``:
  a miss either way, and what was decrypted into the host page is never used.
- Every page gets a fresh random nonce (never reused under a key short of the
  2**32 pages per key GCM allows for random nonces: rotate keys before that).
- The host page is never copied to seal or open it: sealing reads the page's
  regions and writes the ciphertext into a staging buffer the backend sends from
  (or, piece by piece, into a small one it writes each piece from: ``begin``);
  opening decrypts the ciphertext in place, in the host page it was read into, or
  straight from where the store holds it (a mapped page file) into the host page.
- Pages are sealed and opened on the sealer's threads (``workers``, ``seal_workers``)
  as well as the caller's: a seal or open touches only its own page and staging.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import AEADEncryptionContext, Cipher, algorithms, modes

from hicache.storage.call_tenant import current_tenant
from hicache.storage.frame import (
    NONCE_BYTES,
    Buffer,
    Fault,
    PayloadOrder,
    encode_sealed_header,
    sealed_aad,
    sealed_fields,
    set_tag,
)
from hicache.storage.seal_workers import SealWorkers, shared_seal_workers
from hicache.tenancy.keys import KeyRing, TenantKey


class Sealer:
    """Seals and opens pages with the keys of one key ring (thread-safe)."""

    def __init__(self, ring: KeyRing, workers: SealWorkers | None = None) -> None:
        self.ring = ring
        # Threads the backends seal and open a batch's pages on (``seal_workers``).
        self.workers = shared_seal_workers() if workers is None else workers
        # One AES key schedule per secret, built on first use.
        self._ciphers: dict[bytes, algorithms.AES] = {}
        self._local = threading.local()

    def can_seal(self) -> bool:
        """Whether the call's tenant has a key to seal with."""
        return self.ring.write_key(current_tenant()) is not None

    def begin(self, key: bytes, order: PayloadOrder, payload_bytes: int) -> SealStream | None:
        """Start sealing page ``key`` (``payload_bytes`` long) under the call's tenant's
        key, with a fresh nonce; None when the tenant has no key."""
        tenant_key = self.ring.write_key(current_tenant())
        if tenant_key is None:
            return None
        header = encode_sealed_header(
            key, order, payload_bytes, os.urandom(NONCE_BYTES), tenant_key.key_id
        )
        _, nonce, _ = sealed_fields(header)
        encryptor = Cipher(self._cipher(tenant_key), modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(sealed_aad(header))
        return SealStream(encryptor, header)

    def seal(
        self, key: bytes, order: PayloadOrder, payload: Sequence[Buffer], out: memoryview
    ) -> bytes | None:
        """Encrypt ``payload`` (page ``key``'s fragments, in payload order) into
        ``out[:payload bytes]``; the page's sealed header, or None when the call's tenant
        has no key (nothing is written to ``out`` then)."""
        sizes = [memoryview(fragment).nbytes for fragment in payload]
        stream = self.begin(key, order, sum(sizes))
        if stream is None:
            return None
        offset = 0
        for fragment, size in zip(payload, sizes, strict=True):
            stream.update_into(fragment, out[offset : offset + size])
            offset += size
        return stream.finish()

    def open(
        self, header: Buffer, payload: Sequence[memoryview], source: Buffer | None = None
    ) -> Fault | None:
        """Decrypt ``payload`` (a page's fragments holding its ciphertext, in payload
        order) in place, or, given ``source`` (the whole ciphertext, as a store handed it
        back), from ``source`` into ``payload``: the decryption is then the copy. Under
        the key a checked sealed ``header`` names; the fault (``UNKNOWN_KEY``,
        ``BAD_TAG``), or None when it authenticated."""
        tag, nonce, key_id = sealed_fields(header)
        tenant_key = self.ring.read_key(current_tenant(), key_id)
        if tenant_key is None:
            return Fault.UNKNOWN_KEY
        decryptor = Cipher(self._cipher(tenant_key), modes.GCM(nonce, tag)).decryptor()
        decryptor.authenticate_additional_data(sealed_aad(header))
        if source is None:
            for fragment in payload:
                decryptor.update_into(fragment, fragment)
        else:
            ciphertext, offset = memoryview(source).cast("B"), 0
            for fragment in payload:
                size = fragment.nbytes
                decryptor.update_into(ciphertext[offset : offset + size], fragment)
                offset += size
        try:
            decryptor.finalize()
        except InvalidTag:
            return Fault.BAD_TAG
        return None

    def staging(self, nbytes: int) -> memoryview:
        """A buffer of ``nbytes`` for ciphertext, this thread's own and reused by its next
        calls (a fresh one per batch would cost its page faults every time)."""
        buffer: bytearray | None = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < nbytes:
            buffer = bytearray(nbytes)
            self._local.buffer = buffer
        return memoryview(buffer)[:nbytes]

    def _cipher(self, tenant_key: TenantKey) -> algorithms.AES:
        cipher = self._ciphers.get(tenant_key.secret)
        if cipher is None:  # a race builds it twice, harmlessly
            cipher = self._ciphers[tenant_key.secret] = algorithms.AES(tenant_key.secret)
        return cipher


class SealStream:
    """One page being sealed piece by piece, in payload order (``Sealer.begin``): a
    store that writes a page in pieces seals each into a small buffer just before
    writing it, so the ciphertext is written from cache instead of a page-sized
    staging buffer that goes through memory once more. Not thread-safe: one page,
    one thread."""

    def __init__(self, encryptor: AEADEncryptionContext, header: bytearray) -> None:
        self._encryptor = encryptor
        self._header = header

    def update_into(self, data: Buffer, out: memoryview) -> int:
        """Encrypt the next ``data`` into ``out`` (at least as long); bytes written."""
        return self._encryptor.update_into(data, out)

    def finish(self) -> bytes:
        """The page's sealed header, its tag set: once every byte went through."""
        self._encryptor.finalize()
        set_tag(self._header, self._encryptor.tag)
        return bytes(self._header)
