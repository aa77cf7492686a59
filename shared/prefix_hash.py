"""Content addresses of a prompt's KV pages, for prefix caching: what the ingress writes into a request's record.

Page j's hash covers every token up to the end of page j (a chain: each hash is that of the previous hash and the
page's tokens), so equal hashes mean equal prefixes, and so equal keys and values at the same positions. The chain's
root holds what else changes the KV or who may share it: the engine's seed (its model, dtype and page size, from the
slot table's header) and the request's `cache_salt` (vLLM's: tenants that set different salts share nothing).

BLAKE2b, cut to 63 bits (0 stays free to mean "no hash"): a prefix another tenant could reach by a collision would
need a second preimage of a 63-bit keyed digest. No torch: the ingress runs on a SmartNIC's cores.
"""

from __future__ import annotations

import hashlib

import numpy as np

_MASK = (1 << 63) - 1


def prefix_seed(*parts: str) -> int:
    """The engine's part of every chain's root, from what identifies the contents of its KV pages."""
    return int.from_bytes(hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest(), "little") & _MASK


def page_hashes(prompt: list[int] | np.ndarray, page_size: int, seed: int, cache_salt: str = "") -> list[int]:
    """One hash per full page of `prompt` (a last, partial page has none), each nonzero."""
    tokens = np.asarray(prompt, dtype="<i4")
    root = hashlib.blake2b(seed.to_bytes(8, "little") + page_size.to_bytes(4, "little") + cache_salt.encode(),
                           digest_size=8)
    previous, hashes = root.digest(), []
    for j in range(len(tokens) // page_size):
        previous = hashlib.blake2b(previous + tokens[j * page_size:(j + 1) * page_size].tobytes(),
                                   digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "little") & _MASK or 1)
    return hashes
