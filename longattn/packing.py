"""Packed documents: which document each token of a packed row belongs to.

Shape legend: b batch, n length.

Packing puts several documents in one row instead of padding each to the longest. transformers marks the documents
in two ways, and longattn reads both:

- `position_ids` that restart at 0 for each document (what `DataCollatorWithFlattening` produces): a document
  begins wherever a position is not the previous one plus 1;
- the varlen keywords of flash attention, `cu_seq_lens_q` / `cu_seq_lens_k` (`[num_documents + 1]` cumulative
  lengths over the flattened batch) with `max_length_q` / `max_length_k` (`return_flash_attn_kwargs=True`).

Both become `document_ids` `[b, n]`, derived once per forward and passed down to every attention layer, whose
patterns AND `patterns.same_document_mask` into what a query sees. This module depends on torch only.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["document_ids_from_position_ids", "document_ids_from_cu_seq_lens", "packed_document_ids"]


def document_ids_from_position_ids(position_ids: Tensor) -> Tensor:
    """Document ids from positions that restart for each document.

    A document begins at position 0 of a row and wherever a position is not the previous one plus 1
    (`[0, 1, 2, 0, 1]` -> `[0, 0, 0, 1, 1]`), the rule of transformers' `find_packed_sequence_indices`.

    Args:
        position_ids: Integer `[b, n]`.

    Returns:
        Long `[b, n]`, numbered from 0 in each row.
    """
    starts = torch.zeros_like(position_ids, dtype=torch.long)
    starts[:, 1:] = (position_ids[:, 1:] != position_ids[:, :-1] + 1).long()
    return starts.cumsum(dim=1)


def document_ids_from_cu_seq_lens(
    cu_seq_lens: Tensor, *, batch: int, length: int, name: str = "cu_seq_lens_k"
) -> Tensor:
    """Document ids from flash attention's cumulative lengths over the flattened batch.

    Args:
        cu_seq_lens: Integer `[num_documents + 1]`: 0, then the end of each document in the flattened `b * n` tokens.
        batch: b.
        length: n.
        name: The argument's name, for error messages.

    Returns:
        Long `[b, n]`; a document never spans two rows (the flattened batch has one row in transformers).

    Raises:
        ValueError: If `cu_seq_lens` is not a 1-D non-decreasing integer tensor from 0 to `batch * length`, or a
            document crosses the end of a row.
    """
    if cu_seq_lens.dim() != 1 or cu_seq_lens.dtype.is_floating_point or cu_seq_lens.numel() < 2:
        raise ValueError(
            f"`{name}` must be a 1-D integer tensor of cumulative document lengths [0, ..., batch * length], got "
            f"{cu_seq_lens.dtype} {tuple(cu_seq_lens.shape)}"
        )
    ends = cu_seq_lens.long()
    if int(ends[0]) != 0 or int(ends[-1]) != batch * length or bool((ends[1:] < ends[:-1]).any()):
        raise ValueError(
            f"`{name}` must rise from 0 to batch * length = {batch * length} (the tokens of the flattened batch), got "
            f"{ends.tolist()}"
        )
    row_ends = torch.arange(1, batch + 1, device=ends.device) * length
    if bool((~torch.isin(row_ends, ends)).any()):
        raise ValueError(f"`{name}`={ends.tolist()} has a document crossing the end of a row of length {length}")
    flat = torch.searchsorted(ends[1:], torch.arange(batch * length, device=ends.device), right=True)
    return flat.view(batch, length)


def packed_document_ids(
    *,
    position_ids: Tensor | None,
    batch: int,
    length: int,
    cu_seq_lens_q: Tensor | None = None,
    cu_seq_lens_k: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> Tensor | None:
    """The documents of a packed batch, or None when the batch is not packed.

    The varlen keywords win when given (they are the more direct statement); otherwise `position_ids` that restart
    mark the documents. Rows whose real tokens are one document give None, so unpacked batches keep every fast path
    (left padding, whose positions generation fills with a constant, is not a document of its own); under
    `torch.compile` that test would read a tensor on the host, so the ids are always returned.

    Args:
        position_ids: Integer `[b, n]` or `[1, n]`, or None.
        batch: b.
        length: n.
        cu_seq_lens_q: Cumulative query lengths `[num_documents + 1]`; self-attention needs them equal to
            `cu_seq_lens_k`.
        cu_seq_lens_k: Cumulative key lengths `[num_documents + 1]`.
        attention_mask: Bool `[b, n]`, True = real token, or None.

    Returns:
        Long `[b, n]`, or None.

    Raises:
        ValueError: If only one of the varlen keywords is given and the other is not, they differ, or they do not
            describe the batch (`document_ids_from_cu_seq_lens`).
    """
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if cu_seq_lens_q is None or cu_seq_lens_k is None:
            given = "cu_seq_lens_q" if cu_seq_lens_q is not None else "cu_seq_lens_k"
            raise ValueError(
                f"`{given}` was given alone: pass both `cu_seq_lens_q` and `cu_seq_lens_k` (self-attention)."
            )
        if cu_seq_lens_q.shape != cu_seq_lens_k.shape or not torch.equal(cu_seq_lens_q.long(), cu_seq_lens_k.long()):
            raise ValueError(
                f"`cu_seq_lens_q`={cu_seq_lens_q.tolist()} differs from `cu_seq_lens_k`={cu_seq_lens_k.tolist()}: "
                "self-attention has the same documents for queries and keys."
            )
        return document_ids_from_cu_seq_lens(cu_seq_lens_k, batch=batch, length=length)
    if position_ids is None:
        return None
    documents = document_ids_from_position_ids(position_ids.expand(batch, length))
    if torch.compiler.is_compiling():
        return documents
    real = torch.ones_like(documents, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    last = documents.masked_fill(~real, -1).amax(dim=1)
    first = documents.masked_fill(~real, length).amin(dim=1)
    return documents if bool((last > first).any()) else None  # None: the real tokens of every row are one document
