"""The model's input checks: every bad argument of `forward` a named error (TypeError for a wrong
type, ValueError / IndexError for a wrong value), never a bare traceback from a kernel."""
from __future__ import annotations

import torch


def int_tensor(x, name: str) -> torch.Tensor:
    """x as an integer tensor (a list of ints too); floats and bools are refused by name."""
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"Qwen3MoeForCausalLM: {name} must be an integer tensor, got "
                            f"{type(x).__name__}") from e
        if x.numel() == 0:
            x = x.long()
    if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
        raise TypeError(f"Qwen3MoeForCausalLM: {name} must be an integer tensor, got {x.dtype}")
    return x


def mask_of(attention_mask, ids: torch.Tensor) -> torch.Tensor:
    """The bool mask of a padded batch: None = every position; else 0 / 1 values of ids' shape."""
    if attention_mask is None:
        return torch.ones_like(ids, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
    if attention_mask.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids "
                         f"{tuple(ids.shape)}")
    mask = attention_mask.bool()
    if attention_mask.dtype != torch.bool and not bool((attention_mask == mask).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    return mask


def bounds_of(cu_seqlens, T: int):
    """(cu_seqlens as int32 [S+1], its values as a list), checked to rise from 0 to T. One read
    of the values (each tensor op is ~2 us of a decode step)."""
    if cu_seqlens is None:
        return torch.tensor([0, T], dtype=torch.int32), [0, T]
    cu = int_tensor(cu_seqlens, "cu_seqlens")
    bounds = cu.tolist()              # the values as given: no int32 wrap-around before the check
    if cu.dim() != 1 or not bounds or bounds[0] != 0 or bounds[-1] != T or \
            any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must be 1-D, rise from 0 to T={T} and never fall; got "
                         f"{bounds if len(bounds) < 20 else str(bounds[:20]) + '...'}")
    return (cu if cu.dtype == torch.int32 else torch.tensor(bounds, dtype=torch.int32)), bounds


def rows_of(logits_rows, T: int) -> torch.Tensor:
    rows = int_tensor(logits_rows, "logits_rows")
    if rows.dim() != 1:
        raise ValueError(f"logits_rows must be 1-D, got shape {tuple(rows.shape)}")
    if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < T:
        raise IndexError(f"logits_rows {rows.tolist()[:8]} must index the {T} packed rows "
                         f"[0, {T})")
    return rows.long()


__all__ = ["int_tensor", "mask_of", "bounds_of", "rows_of"]
