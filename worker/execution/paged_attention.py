"""The engine's own attention function, registered through transformers' public attention
interface (`AttentionInterface.register`, `model.set_attn_implementation`): it writes each
layer's new keys and values into the paged pool (execution/kv_pool.py) and attends, row by
row, over each row's whole history read from the pool's blocks.

Why: transformers' cache classes (the `Cache` a forward takes, its layers' abstract methods,
the name of the forward's cache argument) changed several times within 5.x, and a cache the
model does not recognise is silently dropped. The attention interface has been stable since
5.0: every model that uses it calls `fn(module, query, key, value, attention_mask, **kwargs)`
for each layer, and `module.layer_idx` says which layer of the pool to use.

The step's layout does not travel as a forward keyword argument: some 5.x models drop
unknown forward kwargs before they reach the layers (GPT-2's LM head in 5.0 does). The
engine sets it for the duration of its forward (`stepping(layout)`, a context variable, so
threads never see each other's), with `use_cache=False` so the model keeps no cache; each
layer that attends counts itself on the layout, and the engine checks that all of them did.

Outside the engine's forward (e.g. `generate()` on the same model) the call goes to
transformers' own `sdpa`, and the mask the model builds is sdpa's: it behaves as before.
In the engine's forward the model builds no mask: the engine passes an all-ones 2D
`attention_mask` (so transformers does not look for packed sequences in the positions, a
device sync) and the registered mask builder returns None while a layout is set.

Each row is its own SDPA call over a view of one unpadded gather of the step's rows, so no
row is padded to the longest one; a prefill chunk on top of a cache gets an explicit
causal mask (its first query sits at position `start`, not 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from worker.execution.step_layouts import DecodeLayout, PackedLayout, StepLayout

NAME = "redbatch_paged"
Layout = StepLayout | DecodeLayout | PackedLayout
_STEP: ContextVar[Layout | None] = ContextVar("redbatch_step", default=None)


@contextmanager
def stepping(layout: Layout) -> Iterator[Layout]:
    """The layout every paged attention call in this context (one forward) uses."""
    token = _STEP.set(layout)
    try:
        yield layout
    finally:
        _STEP.reset(token)


def register() -> None:
    """Register the function, and a mask builder under the same name: sdpa's (what
    `generate()` on a converted model needs), but none in the engine's forward; idempotent."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, paged_attention)
    sdpa_mask = AttentionMaskInterface()["sdpa"]

    def mask(*args: Any, **kwargs: Any) -> Any:
        """No mask in the engine's forward (the layout says what each row sees): building
        one costs a forward dozens of kernels and, on sdpa's checks, a device sync."""
        return None if _STEP.get() is not None else sdpa_mask(*args, **kwargs)

    AttentionMaskInterface.register(NAME, mask)


def use_paged_attention(lm: Any) -> None:
    """Switch a loaded model to the engine's attention (a no-op if already switched)."""
    register()
    if lm.config._attn_implementation != NAME:
        lm.set_attn_implementation(NAME)
    if lm.config._attn_implementation != NAME:  # the model ignored it, with a warning
        raise ValueError(f"{type(lm).__name__} does not route its attention through "
                         "transformers' AttentionInterface: the engine cannot serve it")


def paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None,
                    dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [rows, heads, queries, dim], key and value [rows, kv_heads, queries, dim]: the
    step's new tokens. Returns [rows, queries, heads, dim] (padded queries get zeros)."""
    layout = _STEP.get()
    if layout is None:
        from transformers import AttentionInterface

        sdpa = AttentionInterface()["sdpa"]
        return sdpa(module, query, key, value, attention_mask,  # type: ignore[no-any-return]
                    scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("paged attention has no logit soft-capping or sinks")
    layer = module.layer_idx
    layout.attended += 1
    window = kwargs.get("sliding_window")
    if isinstance(layout, DecodeLayout):
        return decode_attention(query, key, value, layout, layer, scaling, window), None
    if isinstance(layout, PackedLayout):
        return packed_attention(query, key, value, layout, layer, scaling, window), None
    keys = _put_and_gather(layout.pool.keys[layer], key, layout.write, layout.history)
    values = _put_and_gather(layout.pool.values[layer], value, layout.write, layout.history)
    out = query.new_zeros(layout.rows, layout.queries, query.shape[1], query.shape[3])
    for row in range(layout.rows):
        start, end, offset = layout.starts[row], layout.ends[row], layout.offsets[row]
        first = layout.queries - (end - start)  # left padding
        out[row, first:] = attend(query[row, :, first:], keys[offset:offset + end],
                                  values[offset:offset + end], start, scaling, window)
    return out, None


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     layout: DecodeLayout, layer: int, scaling: float | None,
                     window: int | None) -> torch.Tensor:
    """Every row's one new token at once: write the keys and values, gather each row's
    `length` slots, one attention call masked to each row's own keys. query [rows, heads, 1,
    dim], key and value [rows, kv_heads, 1, dim]; returns [rows, 1, heads, dim]."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    gathered = [_put_and_gather(pool, new, layout.write, layout.read)
                .view(rows, layout.length, kv_heads, dim).transpose(1, 2)
                for pool, new in ((layout.pool.keys[layer], key),
                                  (layout.pool.values[layer], value))]
    # grouped query heads ride as queries of their KV head, as attend() does for one row
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(q, gathered[0], gathered[1],
                                         attn_mask=layout.visible(window), scale=scaling)
    return out.reshape(rows, 1, heads, dim)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     layout: PackedLayout, layer: int, scaling: float | None,
                     window: int | None) -> torch.Tensor:
    """Every packed token at once: write the keys and values, gather every row's history,
    one attention call masked to each token's own sequence up to itself. query [1, heads,
    queries, dim], key and value [1, kv_heads, queries, dim]; returns [1, queries, heads,
    dim]."""
    groups = query.shape[1] // key.shape[1]
    gathered = [_put_and_gather(pool, new, layout.write, layout.read).transpose(0, 1)[None]
                .repeat_interleave(groups, dim=1)
                for pool, new in ((layout.pool.keys[layer], key),
                                  (layout.pool.values[layer], value))]
    out = F.scaled_dot_product_attention(query, gathered[0], gathered[1],
                                         attn_mask=layout.visible(window), scale=scaling)
    return out.transpose(1, 2)


def _put_and_gather(pool: torch.Tensor, new: torch.Tensor, write: torch.Tensor,
                    read: torch.Tensor) -> torch.Tensor:
    """Write the new tokens ([rows, kv_heads, queries, dim]) into their `write` slots, then
    read the `read` slots: [len(read), kv_heads, dim]."""
    heads, dim = new.shape[1], new.shape[3]
    pool.index_copy_(0, write, new.transpose(1, 2).reshape(-1, heads, dim))
    return pool.index_select(0, read)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
           scaling: float | None, window: int | None = None) -> torch.Tensor:
    """One row: query [heads, n, dim] at positions [start, start + n), over keys and values
    [start + n, kv_heads, dim] (positions 0..); returns [n, heads, dim]."""
    heads, n, dim = query.shape
    end = keys.shape[0]
    first = max(0, end - window) if window and n == 1 else 0  # a window's oldest key
    k, v = keys[first:].transpose(0, 1)[None], values[first:].transpose(0, 1)[None]
    groups = heads // k.shape[1]
    if n == 1:  # one query sees all of it: no mask; grouped heads ride as queries
        q = query.reshape(1, k.shape[1], groups, dim)
        return F.scaled_dot_product_attention(q, k, v, scale=scaling).reshape(1, heads, dim)
    if groups > 1:  # as transformers' sdpa does: each KV head repeated for its group
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = None
    if start > 0 or window:
        q_pos = torch.arange(start, end, device=query.device)[:, None]
        k_pos = torch.arange(end, device=query.device)[None]
        mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    out = F.scaled_dot_product_attention(query[None], k, v, attn_mask=mask,
                                         is_causal=mask is None, scale=scaling)
    return out[0].transpose(0, 1)
