"""KV cache allocated once: one slot per concurrent sequence, `max_len` positions per slot.

Layout [layers, slots, kv_heads, max_len, head_dim] keeps one sequence's keys contiguous along
positions, so a batch whose slots are consecutive reads them as a view. Zero-filled (not empty)
so that never-written positions hold finite values: they are masked out, and a masked NaN
would still poison the softmax-weighted sum. The dtype is the model's (bfloat16 halves it).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specrl.models.linear import cpu_kernels

FUSED_MAX_TOKENS = 64  # tokens of one sequence the fused kernel takes a call (ATT_MAX_ROWS in _cpu_kernels.c)



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


def fuses(cache: KVCache) -> bool:
    """Whether forwards over `cache` take the fused C attention (float32, the kernels built). A token's result
    there depends on its position and the cache only, never on what else the call holds, so every prompt
    chunk goes through it too, in pieces of FUSED_MAX_TOKENS: a prompt's keys are then the same bits however
    it was chunked or batched, and a prefix-cache hit (keys computed in another request's chunks) cannot
    change a greedy answer. torch's SDPA for long chunks broke that: speculative and plain outputs parted
    after cache hits (`bench adapt` on q4, 1-3 of 8 held-out prompts)."""
    return cpu_kernels is not None and cache.k.dtype == torch.float32 and cache.k.is_contiguous() \
        and cache.v.is_contiguous()


class CacheBatch:
    """Where one forward reads and writes the cache: built once per forward, used by every layer.

    slots [B] int64, positions [B, T] int64 (absolute position of each new token); key j is
    visible to query t iff j <= positions[b, t]; L = max end. The views every layer reads and
    writes are cut once here, over all layers, so a layer pays one index for each:
    - consecutive slots (the engine's usual batch) read keys as a view, no gather;
    - consecutive slots that all start at one position write the new keys with one slice copy;
      otherwise with one index_copy_ at precomputed flat positions.
    """

    def __init__(self, cache: KVCache, slots: torch.Tensor, start: torch.Tensor, num_tokens: int,
                 lengths: torch.Tensor | None = None):
        """cache: the KVCache ([layers, S, KVH, MAX, D] k and v); slots [B], start [B] int64;
        lengths [B] int64: real tokens per row (None: all T). `rows` [N] int64: the flat indices
        (b * T + t) of the real tokens when some row is shorter, else None. Padding is never
        written to the cache, and its positions are clamped to its row's last real one (a row near
        the end of its context may be padded past it)."""
        self.slots, self.positions = slots, start[:, None] + torch.arange(num_tokens)
        self.rows = None
        if lengths is not None and bool((lengths < num_tokens).any()):
            real = torch.arange(num_tokens)[None, :] < lengths[:, None]
            self.rows = real.reshape(-1).nonzero().squeeze(1)
            self.positions = torch.minimum(self.positions, (start + lengths - 1)[:, None])
        slot_ids, starts = slots.tolist(), start.tolist()  # a few values: Python compares them faster than torch
        first = slot_ids[0]
        consecutive = slot_ids == list(range(first, first + len(slot_ids)))
        same_start = all(s == starts[0] for s in starts)
        self.length = length = (max(starts) + num_tokens) if self.rows is None else int(self.positions.max()) + 1
        self.all_visible = num_tokens == 1 and same_start  # every query sees every key: no mask
        self._mask: torch.Tensor | None = None
        k, v = cache.k, cache.v
        layers, _, kvh, max_len, d = k.shape
        if length > max_len:  # the flat write below would land in the next slot's rows
            raise ValueError(f"positions up to {length - 1} do not fit a KV cache of {max_len} positions")
        self._cache, self._first, self._starts, self._num_tokens = cache, first, starts, num_tokens
        self._consecutive, self._same_start = consecutive, same_start
        # The fused kernel (rotary embedding + cache write + attention in one C call a layer) serves float32
        # forwards of up to FUSED_MAX_TOKENS tokens a row; `Llama.forward` cuts longer prefill chunks into
        # such pieces (`fuses`). bfloat16 takes the torch ops below, whose views (`_views`) are cut on first
        # use: a decode step never reads them (building them cost ~40 of the ~80 us this took a step).
        self.fused = fuses(cache) and num_tokens <= FUSED_MAX_TOKENS
        if self.fused:  # the kernel's arguments that hold for every layer, read once (a call costs ~3 us)
            self._flat_tokens = self.rows if self.rows is not None else torch.arange(len(slots) * num_tokens)
            self.positions = self.positions.contiguous()  # the kernel reads it (and `advance` moves it)
            self._slots = slots.to(torch.int64).contiguous()
            self._layer_bytes = k[0].numel() * k.element_size()
            self._kernel_args = (k.data_ptr(), v.data_ptr(), self._slots.data_ptr(), self.positions.data_ptr(),
                                 self._flat_tokens.data_ptr(), len(self._flat_tokens), num_tokens)
            self._kernel_shape = (kvh, d, max_len)

    def advance(self) -> None:
        """Move every row one position on, in place (the next pass of a drafting loop: one token a row, each
        following the one just written), instead of building a new batch (20 us a pass, a tenth of a drafter
        pass at B = 1). A fused batch's kernel arguments point at `positions`, so they stay valid; the torch
        path's views and mask are cut again on their next use."""
        if self._num_tokens != 1 or self.rows is not None:
            raise ValueError("only a batch of one token a row can advance in place")
        if self.length + 1 > self._cache.max_len:
            raise ValueError(f"position {self.length} does not fit a KV cache of {self._cache.max_len} positions")
        self.positions += 1
        self._starts = [s + 1 for s in self._starts]
        self.length += 1
        self.__dict__.pop("_views", None)  # the torch path's views and mask, cut for the old positions
        self._mask = None

    @functools.cached_property
    def _views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The torch path's views, cut once over all layers: (keys, values) to read [layers, B, KVH, L, D] (all
        slots when not consecutive: gathered per layer), (k_dest, v_dest) to write, and the flat write positions
        (None: one slice copy)."""
        k, v = self._cache.k, self._cache.v
        layers, _, kvh, max_len, d = k.shape
        lo, hi, length = self._first, self._first + len(self.slots), self.length
        if self._consecutive:
            keys, values = k[:, lo:hi, :, :length], v[:, lo:hi, :, :length]
        else:
            keys, values = k[:, :, :, :length], v[:, :, :, :length]
        if self._consecutive and self._same_start and self.rows is None:
            s, e = self._starts[0], self._starts[0] + self._num_tokens
            return keys, values, k[:, lo:hi, :, s:e].transpose(2, 3), v[:, lo:hi, :, s:e].transpose(2, 3), None
        heads = torch.arange(kvh)
        flat = (self.slots[:, None, None] * kvh + heads[None, None, :]) * max_len + self.positions[:, :, None]
        if self.rows is not None:  # the real tokens only
            flat = flat.reshape(-1, kvh).index_select(0, self.rows)
        # [B*T*KVH] (or [N*KVH]) rows of k viewed as [layers, S*KVH*MAX, D]
        return keys, values, k.view(layers, -1, d), v.view(layers, -1, d), flat.reshape(-1)

    def mask(self, groups: int, dtype: torch.dtype) -> torch.Tensor | None:
        """-> additive mask [B, 1, G*T, L] (0 visible, -inf hidden) for queries grouped G per KV
        head, or None when every query sees every key. Built on first use (one per forward)."""
        if self.all_visible:
            return None
        if self._mask is None:
            bsz, t = self.positions.shape
            visible = torch.arange(self.length)[None, None, :] <= self.positions[:, :, None]  # [B, T, L]
            additive = torch.zeros(bsz, 1, t, self.length, dtype=dtype).masked_fill_(~visible[:, None], float("-inf"))
            self._mask = additive.expand(bsz, groups, t, self.length).reshape(bsz, 1, groups * t, self.length)
        return self._mask

    def attend_fused(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_heads: int, portable: bool = False) -> torch.Tensor:
        """qkv [N, (NH + 2 KVH) D] float32: the q|k|v projections of the batch's N real tokens (all B*T
        when `rows` is None), unrotated; cos/sin [B, T, 1, D] (Rope.tables) -> attention output
        [N, NH*D]. One C call does what `attend` does after the rotation: k and v written to layer
        `layer` of the cache, then each token attends to its slot's keys up to its position. qkv is
        rotated in place. Only when `fused` (float32, T <= FUSED_MAX_TOKENS, no autograd). portable: the
        kernel's C path whatever the CPU has (tests)."""
        kvh, d, _ = self._kernel_shape
        out = torch.empty(qkv.shape[0], num_heads * d)
        k, v, slots, positions, flat, n, t, max_len = self.kernel_args(layer)
        cpu_kernels.attend(out.data_ptr(), qkv.data_ptr(), k, v, cos.data_ptr(), sin.data_ptr(), slots, positions,
                           flat, n, t, num_heads, kvh, d, max_len, torch.get_num_threads(), portable)
        return out

    @property
    def layer_bytes(self) -> int:
        """Bytes between one layer's k (or v) cache and the next one's (when `fused`): what `_cpu_kernels.layers`
        steps by."""
        return self._layer_bytes

    def kernel_args(self, layer: int) -> tuple[int, ...]:
        """-> the C kernels' cache arguments for `layer` (when `fused`): k and v of the layer, slots,
        positions, flat token indices (pointers), N real tokens, T, the cache's positions per slot."""
        k_base, v_base, slots, positions, flat, n, t = self._kernel_args
        offset = layer * self._layer_bytes
        return k_base + offset, v_base + offset, slots, positions, flat, n, t, self._kernel_shape[2]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, T, KVH, D]: store this layer's new keys/values."""
        _, _, k_dest, v_dest, flat = self._views
        if flat is None:
            k_dest[layer].copy_(k)
            v_dest[layer].copy_(v)
        else:
            kvh, d = k.shape[-2:]
            if self.rows is not None:
                k = k.reshape(-1, kvh, d).index_select(0, self.rows)
                v = v.reshape(-1, kvh, d).index_select(0, self.rows)
            k_dest[layer].index_copy_(0, flat, k.reshape(-1, d))
            v_dest[layer].index_copy_(0, flat, v.reshape(-1, d))

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> keys, values [B, KVH, L, D] of this layer for the batch's slots (a view when consecutive)."""
        keys, values = self._views[:2]
        if self._consecutive:
            return keys[layer], values[layer]
        return keys[layer].index_select(0, self.slots), values[layer].index_select(0, self.slots)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, T, NH, D], k, v [B, T, KVH, D] (this forward's tokens) -> attention output
        [B, T, NH, D] over the slot's history and these tokens (written to the cache first).

        The G = NH/KVH query heads that share a KV head go in as G*T query rows of that head: plain
        multi-head attention over KVH heads, no GQA expansion, and an additive mask built once per
        forward (alone, per layer on SmolLM2 at B=8 T=5: 420 us against 562 with `enable_gqa` and a
        boolean mask). A matmul-softmax-matmul was faster alone (168 against 291 us at B=8 T=1)
        but measured the same inside the whole forward, where the KV reads come from memory."""
        self.write(layer, k, v)
        keys, values = self.read(layer)
        bsz, t, nh, d = q.shape
        kvh = keys.shape[1]
        grouped = q.transpose(1, 2).reshape(bsz, kvh, (nh // kvh) * t, d)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=self.mask(nh // kvh, q.dtype))
        return out.view(bsz, nh, t, d).transpose(1, 2)
