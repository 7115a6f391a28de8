"""KV cache allocated once: one slot per concurrent sequence, `max_len` positions per slot.

Layout [layers, slots, kv_heads, max_len, head_dim] keeps one sequence's keys contiguous along
positions, so a batch whose slots are consecutive reads them as a view. Zero-filled (not empty)
so that never-written positions hold finite values: they are masked out, and a masked NaN
would still poison the softmax-weighted sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32):
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.num_slots, self.max_len = num_slots, max_len

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class CacheBatch:
    """Where one forward reads and writes the cache: built once, shared by every layer.

    slots [B] int64, positions [B, T] int64 (absolute position of each new token),
    mask [B, 1, T, L] bool (key j visible to query t iff j <= position t), L = max end.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    length: int
    slot_range: tuple[int, int] | None  # (first, last+1) when slots are consecutive: read a view

    @classmethod
    def build(cls, slots: torch.Tensor, start: torch.Tensor, num_tokens: int) -> "CacheBatch":
        positions = start[:, None] + torch.arange(num_tokens)
        length = int(positions.max()) + 1
        mask = (torch.arange(length)[None, None, :] <= positions[:, :, None])[:, None]
        first = int(slots[0])
        consecutive = bool(torch.equal(slots, torch.arange(first, first + len(slots))))
        return cls(slots, positions, mask, length, (first, first + len(slots)) if consecutive else None)

    def write(self, cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """cache_k/v [S, KVH, MAX, D]; k, v [B, KVH, T, D]: store the new tokens' keys/values."""
        index = self.slots[:, None]
        cache_k[index, :, self.positions] = k.transpose(1, 2)
        cache_v[index, :, self.positions] = v.transpose(1, 2)

    def read(self, cache_k: torch.Tensor, cache_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> keys, values [B, KVH, L, D] for this batch's slots (a view when slots are consecutive)."""
        if self.slot_range is not None:
            lo, hi = self.slot_range
            return cache_k[lo:hi, :, : self.length], cache_v[lo:hi, :, : self.length]
        return cache_k[self.slots, :, : self.length], cache_v[self.slots, :, : self.length]
