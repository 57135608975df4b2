"""Attention over the union of several block layouts, one softmax: `attend_block_sets` and its `BlockSet`s.

Shape legend: b batch, h heads, h_kv key/value heads (h_kv divides h), h_s the heads a set serves, n_q queries (the
last n_q of n_k positions), nb query blocks of a set, c queries per block, m keys gathered per block, d head dim (d_v
for values).

Some patterns are a union of parts that each need their own block layout: the Sparse Transformer's (Child et al.
2019, "Generating Long Sequences with Sparse Transformers") strided pattern is a band plus every l-th key, its fixed
pattern a block diagonal plus summary cells (`executor_sparse`). A `BlockSet` is one part: blocks of query positions,
the keys each block gathers, and the part's predicate. `attend_block_sets` runs all parts in ONE autograd function
(`_BlockSetAttention`): queries are read and outputs written by index, each chunk's partial attention is merged into
the output by log-sum-exp as soon as it is computed (the merge of `numerics.merge_attention`, row by row), and the
masks (and a relative-position bias) are evaluated from each part's predicate per chunk. Backward does not evaluate
the predicate again: forward keeps each part's mask as its distinct rows (`_MaskBook`), a few per block geometry.

Why: running the parts as separate `attend_blocks` calls merged afterwards keeps every part's output, mask and
gathered, reordered copy of q, and two sets of gradients (10-11 q-sized tensors at the peak); here only q, k, v, the
merged output and its log-sum-exp (O(n · d)) are saved, with each part's mask as its distinct rows and a row number
per query slot, and backward recomputes each chunk's probabilities of the UNION's softmax from them. Under
`torch.compile`, or with a bias function that does not list its tensors, the plain-op form
`_attend_block_sets_traceable` runs instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .executor_chunks import (
    _Chunk,
    _rows,
    _RowView,
    _split_heads,
    _Workspace,
    _zeros_with_rows,
    block_mask,
    evaluate_block_mask,
)
from .executor_gathered import _attend_blocks_traceable
from .numerics import NO_KEY_LSE, compute_dtype, logit_bound, merge_attention, sees_a_key, zero_empty_shift
from .patterns import MaskFn, mask_period
from .relative_logits import BiasFn, block_bias


def _softmax_rows(probs: Tensor) -> Tensor:
    """Softmax of scores `[rows, queries, m]` in place; returns each row's log-sum-exp `[rows·queries]` (finite but
    meaningless where every key is hidden: the mask tells those rows, `_BlockSetAttention` sets them to -inf)."""
    score_max = probs.amax(dim=-1).view(-1)
    torch.ops.aten._softmax.out(probs, -1, False, out=probs)
    # The largest probability is exp(score_max − lse): one cheap reduction instead of a separate exp-sum.
    return score_max - probs.amax(dim=-1).view(-1).log()


@dataclass(frozen=True)
class BlockSet:
    """One layout of a union pattern: blocks of query positions, each gathering its keys, and the predicate that
    decides visibility (evaluated per chunk in forward; kept for backward as its distinct rows, `_MaskBook`).

    Attributes:
        mask_fn: The predicate of this part (e.g. the pattern restricted to the part's geometry, so that every visible
            key of the union lies in exactly one part).
        q_pos: Long `[nb, c]`, the position of each query slot (queries are the last n_q of n_k positions).
        q_valid: Bool `[nb, c]`, False for padding slots; each valid position appears at most once in a set.
        kv_pos: Long `[nb, m]` (block i gathers the keys `kv_pos[i]`) or `[1, m]` (every block attends to the same m
            keys, gathered once per chunk), positions within range.
        kv_valid: Optional bool like `kv_pos`, False for keys that are never seen.
        heads: Optional long `[h_s]`, the query heads this set serves (the others get nothing from it); needs one
            key/value head per query head. None: every head.
    """

    mask_fn: MaskFn
    q_pos: Tensor
    q_valid: Tensor
    kv_pos: Tensor
    kv_valid: Tensor | None = None
    heads: Tensor | None = None

    def mask(self, batch: int, heads: Tensor, start: int, stop: int) -> Tensor:
        """Bool `[b|1, h_s|1, stop − start, c, m]` of blocks start:stop."""
        return block_mask(
            self.mask_fn,
            batch=batch,
            heads=heads,
            q_pos=self.q_pos[None],
            kv_pos=self.kv_pos[None],
            q_valid=self.q_valid[None],
            kv_valid=None if self.kv_valid is None else self.kv_valid[None],
        )(start, stop)

    def bias(self, bias_fn: BiasFn, batch: int, heads: Tensor, start: int, stop: int) -> Tensor:
        """Float `[b, h_s, stop − start, c, m]`: `bias_fn` on the original positions of blocks start:stop (like
        `mask`; padding slots and keys get a value too, hidden by the mask)."""
        kv_pos = self.kv_pos if self.kv_pos.shape[0] == 1 else self.kv_pos[start:stop]
        return block_bias(bias_fn, batch=batch, heads=heads, q_pos=self.q_pos[None, start:stop], kv_pos=kv_pos[None])


@dataclass
class _SetPlan:
    """A `BlockSet` resolved against q, k, v: the heads it serves, its layout as a `_Chunk` grouping, and the rows
    its slots read (`read`, clamped into range) and write (`write`: padding slots go to an extra row n_q, so that
    they never collide with a real query)."""

    block_set: BlockSet
    heads: Tensor  # [h_s]
    h_kv: int  # key/value heads of the chunk layout (h_s when the set selects heads)
    group: int
    read: Tensor  # [nb, c]
    write: Tensor  # [nb, c]
    shared: bool


class _MaskBook:
    """The negated mask (True = hidden) of one set, kept from forward for backward without evaluating its predicate
    again: the set's DISTINCT mask rows `[u, m]` (a query slot's row over the m keys of its block) and, per query
    slot `[b|1, h_s|1, nb, c]`, which row it is (int32).

    The rows of a geometry repeat across blocks: a band's interior blocks see their keys in the same slots, every
    query of a fixed block sees the same summary keys, the residue classes of the strided pattern are alike, and the
    rows inside padding see nothing. At 16K tokens (stride 128; block 128 with 8 summary cells) a set keeps 1-320
    rows and 64 KB of row numbers, 0.25 MB per layer, where its whole mask would take 2-16 MB of bools (one per pair:
    1/4 of one head's float32 score). Backward then reads a chunk's mask with one gather instead of evaluating the
    predicate (~10 int64 passes, ~7% of a strided step at 4K on one thread) and reducing it to the rows that see no
    key; finding the rows costs forward 30-60% of the predicate's time. Forward + backward at 4K, one thread:
    strided 0.87-0.91x, fixed 0.88-0.92x the time of evaluating the predicate again; tensor peak -0.7 to +0.25 MB
    at 16K.

    Rows are told apart by a hash of their bytes (each 8 bools packed into 8 bits by one multiply, the bytes weighted
    by random 64-bit numbers) and then compared exactly: a hash shared by different rows, rows that depend on
    batch or head in one chunk and not in another, or more distinct rows than a quarter of the set's (the book would
    take over 1/4 of the mask) drop the book, and backward evaluates the predicate again (`kept` is False).
    Kept on the CPU only: on an accelerator, finding new rows would need a host sync per chunk and the predicate
    is cheap.
    """

    ready = False  # forward evaluates the predicate and adds its rows (`add`); backward reads them (`hidden`)
    # Times an int64 word of 8 bool bytes (0 or 1): the 8 bools as the bits of the product's top byte.
    _PACK = 0x0102040810204080
    _WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)
    _weights: dict[tuple[int, torch.device], Tensor] = {}  # random int64 weights of a row's words, per row width

    def __init__(self, nb: int, c: int, m: int, device: torch.device):
        self.nb, self.c, self.m = nb, c, m
        self.word = next(word for word in self._WORDS if m % word.itemsize == 0)  # the widest dividing a row
        self.width = m // self.word.itemsize
        self.all_hidden = int.from_bytes(b"\x01" * self.word.itemsize, "little")  # a word of True bools
        weights = self._weights.get((self.width, device))
        if weights is None:
            generator = torch.Generator().manual_seed(self.width)
            weights = torch.randint(-(2**62), 2**62, (self.width,), generator=generator).to(device)
            self._weights[self.width, device] = weights
        self.weights = weights
        self.rows = torch.empty(0, self.width, dtype=self.word, device=device)  # the distinct rows [u, width]
        self.hidden_all = torch.empty(0, dtype=torch.bool, device=device)  # per row: every key hidden
        self.hashes = torch.empty(0, dtype=torch.int64, device=device)  # sorted
        self.order = torch.empty(0, dtype=torch.int64, device=device)  # the row of each sorted hash
        self.ids: Tensor | None = None  # [b|1, h_s|1, nb, c], the row of each query slot
        self.kept = True

    @staticmethod
    def of(plan: _SetPlan, device: torch.device) -> _MaskBook | None:
        nb, c = plan.block_set.q_pos.shape
        m = plan.block_set.kv_pos.shape[1]
        return _MaskBook(nb, c, m, device) if device.type == "cpu" and nb * c * m > 0 else None

    def _drop(self) -> None:
        self.kept, self.rows, self.ids, self.hidden_all, self.hashes, self.order = False, None, None, None, None, None

    def _hash(self, words: Tensor, workspace: _Workspace) -> Tensor:
        packed = workspace.get("book hash", words.shape, torch.int64)
        if words.dtype == torch.int64:
            torch.mul(words, self._PACK, out=packed)
        else:
            packed.copy_(words).mul_(self._PACK)
        return torch.mv(packed.bitwise_right_shift_(56), self.weights)  # 8 bools per word in [-128, 128)

    def _rows_of(self, hashes: Tensor) -> Tensor | None:
        """The book's row of each hash, or None when some hash is not in the book."""
        if not self.hashes.numel():
            return None
        at = torch.searchsorted(self.hashes, hashes).clamp_(max=self.hashes.numel() - 1)
        if not torch.equal(self.hashes.index_select(0, at), hashes):
            return None
        return self.order.index_select(0, at)

    def _learn(self, words: Tensor, hashes: Tensor) -> bool:
        """Add the rows `words` whose hashes are new to the book; False (the book dropped) past its limit."""
        unique, inverse = torch.unique(hashes, return_inverse=True)
        if self.hashes.numel():
            at = torch.searchsorted(self.hashes, unique).clamp_(max=self.hashes.numel() - 1)
            new = self.hashes.index_select(0, at) != unique
        else:
            new = torch.ones_like(unique, dtype=torch.bool)
        added = int(new.sum())
        if self.rows.shape[0] + added > self.limit:
            self._drop()
            return False
        first = torch.full_like(unique, words.shape[0])  # each hash's first row
        first.scatter_reduce_(0, inverse, torch.arange(words.shape[0], device=words.device), "amin")
        new_rows = words.index_select(0, first[new])
        known = self.rows.shape[0]
        self.rows = torch.cat([self.rows, new_rows])
        self.hidden_all = torch.cat([self.hidden_all, (new_rows == self.all_hidden).all(-1)])
        self.hashes, by_hash = torch.cat([self.hashes, unique[new]]).sort()
        self.order = torch.cat([self.order, torch.arange(known, known + added, device=words.device)])[by_hash]
        return True

    def add(self, start: int, stop: int, hidden: Tensor, workspace: _Workspace) -> Tensor | None:
        """Keep blocks start:stop of the negated mask, hidden: contiguous bool `[b|1, h_s|1, n_blk, c, m]`. Returns
        their rows that hide every key (`[b|1, h_s|1, n_blk, c, 1]`), or None once the book is dropped. Temporaries
        the size of the chunk's mask live in the workspace."""
        if not self.kept:
            return None
        if self.ids is None:
            self.ids = torch.empty(*hidden.shape[:2], self.nb, self.c, dtype=torch.int32, device=hidden.device)
            self.limit = self.ids.numel() // 4
        elif hidden.shape[:2] != self.ids.shape[:2]:
            self._drop()
            return None
        words = hidden.view(self.word).view(-1, self.width)
        hashes = self._hash(words, workspace)
        ids = self._rows_of(hashes)
        if ids is None:  # new rows
            if not self._learn(words, hashes):
                return None
            ids = self._rows_of(hashes)
        found = workspace.get(f"book {self.word}", words.shape, self.word)
        if not torch.equal(torch.index_select(self.rows, 0, ids, out=found), words):  # one hash, different rows
            self._drop()
            return None
        shape = (*self.ids.shape[:2], stop - start, self.c)
        self.ids[:, :, start:stop].copy_(ids.view(shape))
        return self.hidden_all.index_select(0, ids).view(*shape, 1)

    def hidden(self, start: int, stop: int, workspace: _Workspace) -> tuple[Tensor, Tensor]:
        """Blocks start:stop of the kept negated mask, `[b|1, h_s|1, n_blk, c, m]` in the "hidden" workspace, and
        their rows that hide every key, `[b|1, h_s|1, n_blk, c, 1]`."""
        ids = self.ids[:, :, start:stop]
        shape = ids.shape
        ids = ids.reshape(-1)
        hidden = workspace.get("hidden", (*shape, self.m), torch.bool)
        torch.index_select(self.rows, 0, ids, out=hidden.view(self.word).view(-1, self.width))
        return hidden, self.hidden_all.index_select(0, ids).view(*shape, 1)


class _MaskTemplate:
    """The negated mask of a set whose predicate is periodic (`patterns.mask_period`), evaluated ONCE per call: on
    one block of each group of blocks that are alike up to a shift by a multiple of the period (the same query and
    key positions relative to the block's period-aligned start, the same valid slots and keys), then read per chunk,
    in forward and backward alike, by one gather of the chunk's blocks' templates (`hidden`, as `_MaskBook.hidden`).

    A band's interior blocks, the residue classes of the strided pattern and the fixed pattern's blocks are each one
    group (plus a few edge blocks): at 16K tokens the predicate runs on a handful of blocks instead of every chunk
    (its ~14 int64 passes over each chunk's pairs were ~40% of a strided forward beside the products). Sets whose
    blocks share their keys (the fixed summary cells) are not shifts of each other and keep `_MaskBook`, as do
    predicates without a period (padding, documents) and sets where the groups would not be few (a quarter of the
    blocks at most). CPU only, like the book (finding the groups reads back a count).
    """

    ready = True  # forward reads the mask from here too
    kept = True

    def __init__(self, hidden: Tensor, group: Tensor):
        self.templates = hidden  # [b|1, h_s|1, g, c, m], contiguous
        self.blind = hidden.all(dim=-1, keepdim=True)  # [b|1, h_s|1, g, c, 1], the rows that see no key
        self.group = group  # [nb], the template of each block

    @staticmethod
    def of(plan: _SetPlan, batch: int) -> _MaskTemplate | None:
        block_set = plan.block_set
        period = mask_period(block_set.mask_fn)
        q_pos, kv_pos = block_set.q_pos, block_set.kv_pos
        nb = q_pos.shape[0]
        if period is None or q_pos.device.type != "cpu" or kv_pos.shape[0] != nb or nb < 4 or q_pos.numel() == 0:
            return None
        base = q_pos[:, :1] - torch.remainder(q_pos[:, :1], period)  # a multiple of the period per block
        # Padding slots and keys see nothing wherever they point: their validity is compared, their positions not.
        q_valid, kv_valid = block_set.q_valid, block_set.kv_valid
        parts = [torch.where(q_valid, q_pos - base, 0), q_valid.long()]
        parts += [kv_pos - base] if kv_valid is None else [torch.where(kv_valid, kv_pos - base, 0), kv_valid.long()]
        unique, group = torch.unique(torch.cat(parts, dim=1), dim=0, return_inverse=True)
        if unique.shape[0] * 4 > nb:
            return None
        first = torch.full((unique.shape[0],), nb, dtype=torch.long, device=q_pos.device)
        first.scatter_reduce_(0, group, torch.arange(nb, device=q_pos.device), "amin")  # each group's first block
        kv_valid = None if block_set.kv_valid is None else block_set.kv_valid[first][None]
        mask = evaluate_block_mask(
            block_set.mask_fn,
            batch=batch,
            heads=plan.heads,
            q_pos=q_pos[first][None],
            kv_pos=kv_pos[first][None],
            q_valid=block_set.q_valid[first][None],
            kv_valid=kv_valid,
        )
        return _MaskTemplate(torch.logical_not(mask), group)

    def hidden(self, start: int, stop: int, workspace: _Workspace) -> tuple[Tensor, Tensor]:
        """Blocks start:stop of the negated mask, `[b|1, h_s|1, n_blk, c, m]` in the "hidden" workspace, and their
        rows that hide every key, `[b|1, h_s|1, n_blk, c, 1]`."""
        group = self.group[start:stop]
        shape = self.templates.shape
        hidden = workspace.get("hidden", (*shape[:2], stop - start, *shape[3:]), torch.bool)
        torch.index_select(self.templates, 2, group, out=hidden)
        return hidden, self.blind.index_select(2, group)


def _set_plans(block_sets: Sequence[BlockSet], h: int, h_kv: int, n_q: int, q_offset: int, device) -> list[_SetPlan]:
    plans = []
    for block_set in block_sets:
        row = block_set.q_pos - q_offset
        heads = torch.arange(h, device=device) if block_set.heads is None else block_set.heads
        selects = block_set.heads is not None
        plans.append(
            _SetPlan(
                block_set=block_set,
                heads=heads,
                h_kv=heads.shape[0] if selects else h_kv,
                group=1 if selects else h // h_kv,
                read=torch.where(block_set.q_valid, row, 0),
                write=torch.where(block_set.q_valid, row, n_q),
                shared=block_set.kv_pos.shape[0] == 1,
            )
        )
    return plans


def _head_rows(base: Tensor, plan: _SetPlan, b: int) -> Tensor:
    """`_rows` bases `[b·h]` of the set's heads, `[b, h_s]`."""
    return base.view(b, -1) if plan.block_set.heads is None else base.view(b, -1)[:, plan.heads]


def _set_view(view: _RowView, plan: _SetPlan, b: int) -> _RowView:
    """A `_rows` view of a `[b, h, n, ·]` tensor narrowed to the set's heads (its `base` `[b·h_s]`)."""
    return view._replace(base=_head_rows(view.base, plan, b).reshape(-1))


def _query_rows(view: _RowView, plan: _SetPlan, index: Tensor, start: int, stop: int, b: int) -> Tensor:
    """Flat row numbers of the slots of blocks start:stop for a `_rows` view of a `[b, h, n, ·]` tensor, in the
    chunk's order: `[b, h_kv, n_blk, group, c]` (blocks gathering their own keys) or `[b, h_kv, group, n_blk, c]`
    (shared keys)."""
    base = _head_rows(view.base, plan, b).reshape(b, plan.h_kv, plan.group)
    slots = index[start:stop] * view.step  # [n_blk, c]
    if plan.shared:
        return (base[:, :, :, None, None] + slots[None, None, None]).reshape(-1)
    return (base[:, :, None, :, None] + slots[None, None, :, None, :]).reshape(-1)


def _set_chunks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: _SetPlan,
    scale: float,
    workspace: _Workspace,
    backward: bool = False,
    book: _MaskBook | _MaskTemplate | None = None,
):
    """Yield `(chunk, (kv_start, kv_stop), blind)` per group of the set's blocks: the `_Chunk` of gathered (scaled)
    queries, keys and values with the negated mask of the predicate, the blocks of `kv_pos` its keys came from (the
    same positions index the key gradients: `_RowView.index`), and the chunk's rows that see no key (`_blind_rows`;
    None: not known from the book).

    The mask: a `_MaskTemplate`'s in both passes; else in forward the predicate's, added to a `_MaskBook` (if any),
    and in backward the book's where it was kept, else the predicate's again.

    Chunks are sized by the workspaces of their pass: backward holds the scores and their gradient, the keys, values
    and their gradients; forward only the scores, keys and values, so its chunks take up to twice the blocks (fewer
    chunks: the mask, gathers and merges per chunk cost the same at any size) without raising the step's peak,
    which comes in backward, where the q, k, v gradients exist."""
    b, _, _, d = q.shape
    d_v = v.shape[3]
    block_set = plan.block_set
    nb, c = block_set.q_pos.shape
    m = block_set.kv_pos.shape[1]
    h_s = plan.h_kv * plan.group
    q_view = _rows(q)
    k_view, v_view = (_set_view(_rows(t), plan, b) for t in (k, v))
    buffers = 2 if backward else 1  # scores (and their gradient); keys and values (and their gradients)
    keys_once = 2 * buffers * b * plan.h_kv * m * max(d, d_v) if plan.shared else 0
    per_block = buffers * b * h_s * c * m + 4 * b * h_s * c * max(d, d_v)
    if not plan.shared:
        per_block += 2 * buffers * b * plan.h_kv * m * max(d, d_v)
    step = _Workspace.blocks_per_chunk(per_block, nb, keys_once)

    def gather_keys(kv_start: int, kv_stop: int) -> tuple[Tensor, Tensor]:
        kv_count = b * plan.h_kv * (kv_stop - kv_start) * m
        key_rows = k_view.index(block_set.kv_pos, kv_start, kv_stop)
        keys = torch.index_select(k_view.flat, 0, key_rows, out=workspace.get("keys", (kv_count, d)))
        value_rows = v_view.index(block_set.kv_pos, kv_start, kv_stop)
        return keys, torch.index_select(v_view.flat, 0, value_rows, out=workspace.get("values", (kv_count, d_v)))

    if plan.shared:  # the same keys for every block: gathered once for the set
        keys, values = gather_keys(0, 1)
    for start in range(0, nb, step):
        stop = min(nb, start + step)
        n_blk = stop - start
        shape6 = (b, plan.h_kv, plan.group, n_blk, c)
        if book is not None and book.kept and (backward or book.ready):
            hidden, blind = book.hidden(start, stop, workspace)
        else:
            hidden = block_set.mask(b, plan.heads, start, stop)
            hidden = torch.logical_not(hidden, out=workspace.get("hidden", hidden.shape, torch.bool))
            blind = book.add(start, stop, hidden, workspace) if book is not None and not backward else None
        hidden6 = _split_heads(hidden, plan.h_kv)
        rows = _query_rows(q_view, plan, plan.read, start, stop, b)
        q_chunk = torch.index_select(q_view.flat, 0, rows, out=workspace.get("q", (rows.shape[0], d))).mul_(scale)
        kv_start, kv_stop = (0, 1) if plan.shared else (start, stop)
        if not plan.shared:
            keys, values = gather_keys(start, stop)
        batches = b * plan.h_kv * (kv_stop - kv_start)
        chunk = _Chunk(
            start,
            stop,
            q_chunk.view(batches, -1, d),
            keys.view(batches, m, d),
            values.view(batches, m, d_v),
            hidden6,
            shape6,
        )
        yield chunk, (kv_start, kv_stop), None if blind is None else _split_heads(blind, plan.h_kv)


class _BlockSetAttention(torch.autograd.Function):
    """Forward and backward of `attend_block_sets` (see there for shapes).

    Forward merges each chunk's partial attention into the output and log-sum-exp of its queries at once (the
    log-sum-exp merge of `merge_attention`, row by row), so no part's output exists beside the result. Saved: q, k,
    v, the merged output O and log-sum-exp L (O(n · d)); each set's mask as its `_MaskBook` (distinct rows and a row
    number per query slot; the predicate is evaluated again where no book was kept). Backward recomputes each
    chunk's probabilities of the UNION's softmax, P = exp(S − L), and uses D = rowsum(dO ∘ O) of the merged output:
    dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − D) (+ P ∘ dL), dQ = dS K · scale, dK = dSᵀ Q · scale, all parts adding into one set
    of gradients (as `_BandAttention` does with the fused kernel's backward).

    A logit bias (`bias_fn`) is evaluated per chunk like the masks, in forward and again in backward; its gradient
    is dS itself, passed per chunk through the bias's own read (`torch.autograd.grad` of the chunk's bias) to the
    tensors it reads, `bias_tensors` (inputs here, e.g. the O(n · M) relative-logit table), so nothing n x keys is
    kept.
    """

    @staticmethod
    def forward(ctx, q, k, v, plans, scale, dropout_p, seed, bias_fn, *bias_tensors):
        b, h, n_q, _ = q.shape
        d_v = v.shape[3]
        dtype = compute_dtype(q.dtype)
        device = q.device
        # One extra row n_q takes the writes of padding slots. [b, n_q + 1, h, d_v] memory seen as [b, h, n_q + 1, d_v]:
        # merging the heads of the result is a view.
        out = torch.zeros(b, n_q + 1, h, d_v, dtype=dtype, device=device).transpose(1, 2)
        lse = torch.full((b, h, n_q + 1), NO_KEY_LSE, dtype=dtype, device=device)
        out_view, lse_view = _rows(out), _rows(lse.unsqueeze(-1))
        workspace = _Workspace(dtype, device, dropout_p=dropout_p, seed=seed)
        # A bias function's values are not bounded in advance: hidden logits are then -inf exactly.
        bound = logit_bound(q, k, scale) if bias_fn is None else None
        k, v = k.to(dtype), v.to(dtype)
        books = [_MaskTemplate.of(plan, b) or _MaskBook.of(plan, device) for plan in plans]
        for index, (plan, book) in enumerate(zip(plans, books)):
            for chunk, _, blind in _set_chunks(q.to(dtype), k, v, plan, scale, workspace, book=book):
                bias = None if bias_fn is None else _set_bias(bias_fn, plan, b, chunk)
                probs = chunk.scores(bias, workspace, bound)
                row_lse = _softmax_rows(probs)
                # A row whose keys are all hidden (by the mask, whatever its values): no key, lse = -inf.
                blind = _blind_rows(chunk) if blind is None else blind
                chunk.view6(row_lse.view(*chunk.scores_shape[:2], 1)).masked_fill_(blind, NO_KEY_LSE)
                workspace.drop(probs)
                chunk_out = torch.bmm(probs, chunk.values, out=workspace.get("out", chunk.out_shape)).view(-1, d_v)
                write = _query_rows(out_view, plan, plan.write, chunk.start, chunk.stop, b)
                lse_write = _query_rows(lse_view, plan, plan.write, chunk.start, chunk.stop, b)
                if index == 0:  # nothing to merge with yet: the same values as a merge, without reading them
                    chunk_out.masked_fill_((row_lse == NO_KEY_LSE).unsqueeze(-1), 0.0)  # rows that saw no key
                    out_view.flat.index_copy_(0, write, chunk_out)
                    lse_view.flat.view(-1).index_copy_(0, lse_write, row_lse)
                else:
                    _merge_rows(out_view.flat, lse_view.flat.view(-1), write, lse_write, chunk_out, row_lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plans, ctx.scale, ctx.dropout_p, ctx.seed, ctx.bound = plans, scale, dropout_p, seed, bound
        ctx.books = books
        # Held by the bias function anyway; read again in backward (through it) for their gradients.
        ctx.bias_fn, ctx.bias_tensors = bias_fn, bias_tensors
        ctx.set_materialize_grads(False)
        return out[:, :, :n_q].to(q.dtype), lse[:, :, :n_q]

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        plans, scale, dropout_p = ctx.plans, ctx.scale, ctx.dropout_p
        b, h, n_q, d = q.shape
        d_v = v.shape[3]
        dtype = compute_dtype(q.dtype)
        device = q.device
        if grad_out is None:
            grad_out = torch.zeros(b, h, n_q, d_v, dtype=dtype, device=device)
        grad_out = grad_out.to(dtype)
        stat_rows = _rows(_row_statistics(out[:, :, :n_q], lse[:, :, :n_q], grad_out, grad_lse))
        grad_out_rows = _rows(grad_out)
        (grad_q, grad_q_view), (grad_k, grad_k_view), (grad_v, grad_v_view) = (
            _zeros_with_rows(t, dtype) for t in (q, k, v)
        )
        workspace = _Workspace(dtype, device, dropout_p=dropout_p, seed=ctx.seed)
        k_c, v_c = k.to(dtype), v.to(dtype)
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[8:]) if need]  # bias tensors needing a gradient
        grad_bias = [None] * len(ctx.bias_tensors)
        for plan, book in zip(plans, ctx.books):
            kv_pos = plan.block_set.kv_pos
            grad_k_set, grad_v_set = (_set_view(view, plan, b) for view in (grad_k_view, grad_v_view))
            chunks = _set_chunks(q.to(dtype), k_c, v_c, plan, scale, workspace, backward=True, book=book)
            for chunk, (kv_start, kv_stop), blind in chunks:
                # Keys shared by every block of the set: their gradients add up over the chunks in one workspace,
                # scattered back once after the last chunk.
                accumulate = plan.shared and chunk.start > 0
                start, stop = chunk.start, chunk.stop
                batches, queries = chunk.q.shape[:2]
                row_stats = _read_slots(stat_rows, plan, chunk, b, workspace, "stats").view(batches, queries, -1)
                row_l, row_d, *row_dl = row_stats.split(1, dim=-1)  # [batches, queries, 1] each
                probs, bias = _union_probs(chunk, plan, b, ctx.bias_fn, ctx.bound, row_l, workspace, blind)
                grad_out_chunk = _read_slots(grad_out_rows, plan, chunk, b, workspace, "grad_out")
                grad_out_chunk = grad_out_chunk.view(batches, queries, d_v)
                grad_scores = workspace.get("grad_scores", chunk.scores_shape)
                torch.bmm(grad_out_chunk, chunk.values.transpose(1, 2), out=grad_scores)  # dP
                keep = workspace.drop(grad_scores)  # forward's mask, drawn again
                grad_scores.sub_(row_d).mul_(probs)  # dS = P ∘ (dP − D)
                if row_dl:
                    grad_scores.addcmul_(probs, row_dl[0])
                if wanted:  # the bias adds to the scores: its gradient is dS
                    _add_bias_gradients(bias, ctx.bias_tensors, wanted, chunk.view6(grad_scores), grad_bias)
                if keep is not None:
                    probs.mul_(keep)  # dV needs the dropped probabilities, dS needed the undropped ones
                grad_values, grad_keys, grad_q_chunk = chunk.gradients(
                    probs, grad_scores, grad_out_chunk, workspace, accumulate=accumulate
                )
                grad_q_index = _query_rows(grad_q_view, plan, plan.read, start, stop, b)
                # Padding slots read row 0 of their head: their P, hence their gradients, are exactly 0.
                grad_q_view.flat.index_add_(0, grad_q_index, grad_q_chunk.view(-1, d), alpha=scale)
                if plan.shared and stop < plan.block_set.q_pos.shape[0]:
                    continue  # more chunks add to the shared keys' gradients
                grad_k_view.flat.index_add_(0, grad_k_set.index(kv_pos, kv_start, kv_stop), grad_keys.view(-1, d))
                grad_v_view.flat.index_add_(0, grad_v_set.index(kv_pos, kv_start, kv_stop), grad_values.view(-1, d_v))
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None, None, *grad_bias


def _row_statistics(out: Tensor, lse: Tensor, grad_out: Tensor, grad_lse: Tensor | None) -> Tensor:
    """What backward reads per query of the merged output out `[b, h, n_q, d_v]` (lse `[b, h, n_q]`, grad_out like
    out), `[b, h, n_q, 2 | 3]`, side by side so that a chunk reads them with one gather: L with -inf as 0 (a chunk's
    rows that see no key get P = 0 from their mask), D = rowsum(dO ∘ O), and dL when the log-sum-exp has a gradient."""
    b, h, n_q, d_v = grad_out.shape
    stats = torch.empty(b, h, n_q, 2 if grad_lse is None else 3, dtype=grad_out.dtype, device=grad_out.device)
    stats[..., 0] = lse
    zero_empty_shift(stats[..., 0], inplace=True)
    step = _Workspace.blocks_per_chunk(b * h * d_v, n_q)  # queries per slice
    for start in range(0, n_q, step):  # a slice at a time: no [b, h, n_q, d_v] temporary
        stop = min(n_q, start + step)
        stats[:, :, start:stop, 1] = torch.linalg.vecdot(grad_out[:, :, start:stop], out[:, :, start:stop])
    if grad_lse is not None:
        stats[..., 2] = grad_lse
    return stats


def _read_slots(view: _RowView, plan: _SetPlan, chunk: _Chunk, b: int, workspace, name: str):
    """The rows of a `[b, h, n_q, width]` tensor (its `_rows` view) that the chunk's query slots read (`plan.read`),
    `[rows·queries, width]` in the chunk's order, gathered into the workspace `name`."""
    index = _query_rows(view, plan, plan.read, chunk.start, chunk.stop, b)
    return torch.index_select(view.flat, 0, index, out=workspace.get(name, (index.shape[0], view.flat.shape[1])))


def _union_probs(
    chunk: _Chunk, plan: _SetPlan, b: int, bias_fn, bound, row_l: Tensor, workspace: _Workspace, blind: Tensor | None
):
    """A chunk's probabilities under the UNION's softmax, `[rows, queries, m]` in the "probs" workspace, recomputed
    in backward from the merged log-sum-exp row_l `[rows, queries, 1]` (blind: the chunk's rows that see no key, None:
    told from its mask); and the chunk's bias as read with autograd on (None without `bias_fn`), for the gradients of
    the tensors it reads (`_add_bias_gradients`)."""
    bias = None
    if bias_fn is not None:
        with torch.enable_grad():  # the chunk's read of the bias tensors, differentiated in `_add_bias_gradients`
            bias = _set_bias(bias_fn, plan, b, chunk)
    probs = chunk.scores(None if bias is None else bias.detach(), workspace, bound)
    # P of the union's softmax, exp(S − L), as the chunk's softmax times exp(lse_chunk − L): torch's softmax kernel
    # exponentiates the hidden keys' scores (near HIDDEN_LOGIT) ~10x faster than `exp_`. The chunk's rows that see no
    # key (by their mask) get P = 0.
    row_lse = _softmax_rows(probs).view(*chunk.scores_shape[:2], 1)
    factor = row_lse.sub_(row_l).exp_()
    chunk.view6(factor).masked_fill_(_blind_rows(chunk) if blind is None else blind, 0.0)
    return probs.mul_(factor), bias


def _add_bias_gradients(bias: Tensor, tensors, wanted: list[int], grad_bias6: Tensor, grad_bias: list) -> None:
    """Add a chunk's share to the gradients `grad_bias` of the bias tensors `wanted`: the bias adds to the scores, so
    its gradient is dS (grad_bias6, in the bias's layout), passed through the chunk's read of the bias."""
    parts = torch.autograd.grad(bias, [tensors[i] for i in wanted], grad_bias6, allow_unused=True)
    for i, part in zip(wanted, parts):
        if part is not None:
            grad_bias[i] = part if grad_bias[i] is None else grad_bias[i].add_(part)


def _blind_rows(chunk: _Chunk) -> Tensor:
    """Bool `[b|1, h_kv|1, group|1, n_blk, c, 1]`: the chunk's query rows whose keys its mask hides all."""
    return ~sees_a_key(chunk.hidden)


def _set_bias(bias_fn: BiasFn, plan: _SetPlan, batch: int, chunk: _Chunk) -> Tensor:
    """The bias of a chunk's pairs as `[b, h_kv, group, n_blk, c, m]`, the layout of `chunk.view6` of its scores."""
    return _split_heads(plan.block_set.bias(bias_fn, batch, plan.heads, chunk.start, chunk.stop), plan.h_kv)


def _merge_rows(out_rows: Tensor, lse_rows: Tensor, write: Tensor, lse_write: Tensor, chunk_out: Tensor, chunk_lse):
    """Merge a chunk's partial attention (chunk_out `[r, d_v]`, chunk_lse `[r]`, -inf where it saw no key) into the
    rows `write` of out_rows `[rows, d_v]` and `lse_write` of lse_rows `[rows]`, by log-sum-exp (as `merge_attention`).
    """
    old_lse = lse_rows.index_select(0, lse_write)
    shift = torch.maximum(old_lse, chunk_lse)
    zero_empty_shift(shift, inplace=True)
    old_weight, new_weight = (old_lse - shift).exp_(), (chunk_lse - shift).exp_()
    total = old_weight + new_weight
    lse_rows.index_copy_(0, lse_write, total.log().add_(shift))
    total.masked_fill_(total == 0, 1.0)
    merged = out_rows.index_select(0, write).mul_(old_weight.div_(total).unsqueeze(-1))
    merged.addcmul_(chunk_out, new_weight.div_(total).unsqueeze(-1))
    out_rows.index_copy_(0, write, merged)


def attend_block_sets(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_sets: Sequence[BlockSet],
    *,
    scale: float,
    dropout_p: float = 0.0,
    bias_fn: BiasFn | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention over the union of several block layouts of the same queries (a pattern whose parts need different
    layouts, e.g. the Sparse Transformer's band and residue classes), one softmax over all of them.

    Every visible key must lie in exactly one set (restrict each set's predicate to its own geometry). Costs the sum
    of the sets' `attend_blocks` costs; memory O(b · h · n · d) for q, k, v, the output and one log-sum-exp per
    query (saved for backward), plus workspaces of at most `executor_chunks._WORKSPACE_ELEMENTS`, plus each set's
    mask as its distinct rows and a row number per query slot (`_MaskBook`; the rows at most 1/4 of the mask): no
    gathered queries and no partial output of a set is kept, and the sets' gradients add into one set of gradient
    tensors.

    Args:
        q: Queries `[b, h, n_q, d]`, the last n_q of the n_k positions.
        k: Keys `[b, h_kv, n_k, d]`, h_kv dividing h (h_kv = h for sets that select heads).
        v: Values `[b, h_kv, n_k, d_v]`.
        block_sets: The `BlockSet`s (a query may appear in several sets, at most once in each).
        scale: Multiplier of q·k.
        dropout_p: Dropout on the attention probabilities.
        bias_fn: Optional logit bias of each pair (relative-position logits, `relative_logits.BiasFn`), evaluated on
            each chunk's positions (forward and again in backward) and added to scale · q·k. Its gradient reaches the
            tensors it lists in `bias_fn.tensors` (`relative_bias_fn` lists its table); a bias function without that
            list runs in plain ops (`_attend_block_sets_traceable`, masks and biases materialised per set), where
            autograd finds its tensors itself.

    Returns:
        `(out, lse)`: out `[b, h, n_q, d_v]` in the dtype of q (stored as `[b, n_q, h, d_v]`, so merging the heads is a
        view; queries that see no key get zeros), lse `[b, h, n_q]` (-inf where no key is seen).

    Raises:
        ValueError: If shapes do not match.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [b, h, n, d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    if k.shape[0] != b or h_kv == 0 or h % h_kv or v.shape[:3] != k.shape[:3] or k.shape[3] != d or n_q > n_k:
        raise ValueError(
            f"k, v must be [{b}, h_kv, n_k >= {n_q}, {d}] with h_kv dividing {h}; got {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    for block_set in block_sets:
        if (
            block_set.q_pos.dim() != 2
            or block_set.kv_pos.dim() != 2
            or block_set.kv_pos.shape[0]
            not in (
                1,
                block_set.q_pos.shape[0],
            )
        ):
            raise ValueError(
                f"block set q_pos must be [nb, c] and kv_pos [nb or 1, m]; got {tuple(block_set.q_pos.shape)}, "
                f"{tuple(block_set.kv_pos.shape)}"
            )
        if block_set.heads is not None and h_kv != h:
            raise ValueError(f"a block set that selects heads needs one key/value head per query head; got h_kv={h_kv}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    bias_tensors = () if bias_fn is None else getattr(bias_fn, "tensors", None)
    if torch.compiler.is_compiling() or bias_tensors is None:
        return _attend_block_sets_traceable(q, k, v, block_sets, scale=scale, dropout_p=dropout_p, bias_fn=bias_fn)
    plans = _set_plans(block_sets, h, h_kv, n_q, n_k - n_q, q.device)
    seed = int(torch.randint(0, 2**62, (), device="cpu")) if dropout_p > 0 else 0
    return _BlockSetAttention.apply(q, k, v, plans, float(scale), float(dropout_p), seed, bias_fn, *bias_tensors)


def _attend_block_sets_traceable(q, k, v, block_sets, *, scale, dropout_p, bias_fn=None):
    """`attend_block_sets` in plain differentiable ops (see `_attend_blocks_traceable`): each set through
    `_attend_blocks_traceable` with its mask (and bias) materialised, scattered to query order, merged by
    `merge_attention`."""
    b, h, n_q, d = q.shape
    q_offset = k.shape[2] - n_q
    partials = []
    for block_set in block_sets:
        nb, c = block_set.q_pos.shape
        heads = torch.arange(h, device=q.device) if block_set.heads is None else block_set.heads
        q_s, k_s, v_s = (q, k, v) if block_set.heads is None else (t.index_select(1, heads) for t in (q, k, v))
        row = block_set.q_pos - q_offset
        q_blocks = q_s.index_select(2, torch.where(block_set.q_valid, row, 0).reshape(-1))
        q_blocks = q_blocks.view(b, heads.shape[0], nb, c, d)
        out_b, lse_b = _attend_blocks_traceable(
            q_blocks,
            k_s,
            v_s,
            kv_index=block_set.kv_pos.expand(nb, -1),
            mask=block_set.mask(b, heads, 0, nb),
            scale=scale,
            dropout_p=dropout_p,
            bias=None if bias_fn is None else block_set.bias(bias_fn, b, heads, 0, nb),
        )
        # Padding slots write to an extra row n_q, cut off below.
        write = torch.where(block_set.q_valid, row, n_q).reshape(1, -1)
        out = q.new_zeros(b, h, n_q + 1, v.shape[3], dtype=out_b.dtype)
        out[:, heads[:, None], write] = out_b.reshape(b, heads.shape[0], nb * c, -1)
        lse = torch.full((b, h, n_q + 1), NO_KEY_LSE, dtype=lse_b.dtype, device=q.device)
        lse[:, heads[:, None], write] = lse_b.reshape(b, heads.shape[0], nb * c)
        partials.append((out[:, :, :n_q], lse[:, :, :n_q]))
    return merge_attention(partials)
