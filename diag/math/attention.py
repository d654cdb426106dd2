"""Statistics of the attention a model really computed: entropy, rank, max logit.

Pure tensor math. Inputs are the logits the model fed to its softmax (eager
attention), or the q, k, mask and scale it passed to a fused attention kernel;
both lead to the same float64 computation on a few sampled sequences.

Shapes: N sampled sequences, H heads, Q query positions, K key positions.

* Masked keys are excluded: their logit is -inf, or an additive mask value at or
  below half the most negative number of its dtype (Hugging Face adds
  ``torch.finfo(dtype).min``).
* A query row is valid when at least one key is not masked and, when the caller
  passes ``query_valid`` (N, Q), the row is a real token there (not padding: see
  :func:`valid_query_rows`); statistics average over valid rows only, and the max
  logit is taken over them.
* ``attn_rank`` is the effective rank (Roy & Vetterli) of the attention matrix of
  one sequence and head restricted to ``rank_rows`` of its query rows that are real
  tokens, spread evenly from the first to the last (:func:`spread_rows`: at a causal
  context of 4,096 the rank sees rows from the whole context, not a prefix where each
  row has at most ``rank_rows`` keys); rows with no key and masked keys contribute
  zero rows and columns, which do not change the nonzero singular values; averaged
  over the sampled sequences that have a valid row among those. ``rows`` is the mean
  number of valid rows the rank saw.
* ``attn_sink`` is the largest share of all queries' attention that one key position
  holds: per sequence, each key's column of probabilities summed over the valid rows
  and divided by their number; averaged over the sampled sequences; the largest such
  share over the keys (``attn_sink_pos``: its position, 0 for the first token). An
  attention sink (Xiao et al. 2023) puts most of every query's mass on one position
  shared by every sequence (the first token in pretrained language models): a share
  near 1. A head whose queries pick different keys, or the same token at other
  positions in other sequences, has a small one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from diag.math.spectral import effective_rank

__all__ = [
    "AttentionStats",
    "excluded_by_additive_mask",
    "attention_logits",
    "LazyLogits",
    "valid_query_rows",
    "stats_from_logits",
    "sink_reference",
    "spread_rows",
    "spread_positions",
    "solve_ranks",
    "SOLVE_BYTES",
    "PendingRank",
    "stats_from_probabilities_reference",
]

# Bytes of float64 logits processed at once per sequence; bounds the capture's memory.
_CHUNK_BYTES = 32 * 2**20


@dataclass
class AttentionStats:
    """Per-head results, each a float64 tensor of shape (H,)."""

    entropy: Tensor
    rank: Tensor | None  # None while ``pending``
    max_logit: Tensor
    rows: Tensor  # (1,): valid query rows per sequence that the rank saw (mean over sequences)
    uniform_entropy: Tensor  # (H,): the entropy uniform attention over the same valid keys would have
    sink: Tensor  # (H,): the largest share of the queries' mass on one key position (mean over sequences)
    sink_pos: Tensor  # (H,): that key's position (float64, a whole number)
    # (H, R, C) float32: the attention probabilities of the first sampled sequence, its first
    # R <= MAP_SIZE query rows over its first C <= MAP_SIZE keys (for images of flagged heads).
    maps: Tensor | None = None
    # The rank waiting for its eigenvalues (rank is None meanwhile): see solve_ranks.
    pending: PendingRank | None = None


# Query rows and keys of the first sequence kept in AttentionStats.maps.
MAP_SIZE = 128


def excluded_by_additive_mask(x: Tensor) -> Tensor:
    """True where an additive mask (or logits with the mask added) excludes a key."""
    if x.dtype == torch.bool:
        raise TypeError("excluded_by_additive_mask: got a boolean mask, which marks allowed keys; pass an additive "
                        "(float) mask, or use ~mask for the excluded keys")
    return x <= torch.finfo(x.dtype).min / 2


def attention_logits(
    q: Tensor,
    k: Tensor,
    scale: float | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
) -> Tensor:
    """Float64 logits (N, H, Q, K) as ``F.scaled_dot_product_attention`` defines them.

    q: (N, H, Q, D); k: (N, G, K, D) with G dividing H (grouped-query attention is
    expanded as SDPA's ``enable_gqa`` does). attn_mask: boolean (True = attend) or
    additive, broadcastable to (N, H, Q, K). Excluded entries are -inf.
    """
    n_heads, n_kv = q.shape[1], k.shape[1]
    if n_kv != n_heads:
        k = k.repeat_interleave(n_heads // n_kv, dim=1)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale  # (N, H, Q, K)
    if is_causal:
        n_q, n_k = logits.shape[-2:]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        logits = logits.masked_fill(~allowed, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attn_mask, -math.inf)
        else:
            excluded = excluded_by_additive_mask(attn_mask)
            logits = (logits + attn_mask.double()).masked_fill(excluded, -math.inf)
    return logits


class LazyLogits:
    """The logits of :func:`attention_logits`, computed a block of query rows at a time.

    Same arguments and the same float64 numbers, but nothing of size Q x K per head is
    ever held whole: :func:`stats_from_logits` asks for (H, rows, K) blocks of one
    sequence at a time, so memory stays O(rows x K) however long the sequence. Masks:
    each of ``masks`` is boolean (True = attend) or additive, broadcastable to
    (N, H, Q, K).
    """

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        scale: float | None = None,
        masks: tuple[Tensor | None, ...] = (),
        is_causal: bool = False,
    ) -> None:
        self.q, self.k, self.is_causal = q, k, is_causal
        self.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        self.masks = [m for m in masks if m is not None]
        self.shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        self._keys: tuple[tuple[int, torch.dtype], Tensor] | None = None

    def rows(self, i: int, start: int, stop: int) -> Tensor:
        """Float64 logits (H, stop - start, K) of sequence i; excluded entries are -inf."""
        return self.rows_at(i, slice(start, stop))

    def rows_at(self, i: int, rows: slice | Tensor, dtype: torch.dtype = torch.float64, keys: int | None = None
                ) -> Tensor:
        """Logits (H, rows, K) of sequence i at the query positions ``rows`` (a slice, or a 1-D tensor of
        positions), in ``dtype`` (float64 unless asked); excluded entries are -inf. ``keys``: only the first
        this many keys (H, rows, keys)."""
        n_heads, n_kv = self.shape[1], self.k.shape[1]
        n_keys = self.shape[3] if keys is None else keys
        if self._keys is None or self._keys[0] != (i, dtype):
            self._keys = ((i, dtype), self.k[i].to(dtype))  # (G, K, D): one sequence's keys, not repeated per head
        q = self.q[i, :, rows].to(dtype)  # (H, c, D); query head h pairs with key head h // (H / G)
        n_rows = q.shape[1]
        key_t = self._keys[1][:, None, :n_keys].transpose(-1, -2)
        logits = (q.reshape(n_kv, n_heads // n_kv, n_rows, q.shape[-1]) @ key_t).reshape(n_heads, n_rows, n_keys)
        logits = logits * self.scale
        if isinstance(rows, slice):
            position = torch.arange(self.shape[2], device=logits.device)[rows][:, None]
        else:
            position = rows[:, None]
        if self.is_causal:
            logits = logits.masked_fill(torch.arange(n_keys, device=logits.device) > position, -math.inf)
        for mask in self.masks:
            m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
            m = m[i if m.shape[0] > 1 else 0]  # (1 | H, 1 | Q, 1 | K)
            m = m[:, rows] if m.shape[1] > 1 else m
            m = m[..., :n_keys] if m.shape[2] > 1 else m
            if m.dtype == torch.bool:
                logits = logits.masked_fill(~m, -math.inf)
            else:
                logits = (logits + m.to(dtype)).masked_fill(excluded_by_additive_mask(m), -math.inf)
        return logits

    def excluded(self) -> Tensor:
        """(N, Q, K) bool: True where the causal flag or a mask excludes key j from row i (of query head 0;
        padding masks do not differ between heads). Reads the masks only, never q or k."""
        n_seq, _, n_q, n_k = self.shape
        dev = self.q.device
        out = torch.zeros(n_seq, n_q, n_k, dtype=torch.bool, device=dev)
        if self.is_causal:
            out |= torch.ones(n_q, n_k, dtype=torch.bool, device=dev).tril().logical_not()
        for mask in self.masks:
            m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))[:, 0]  # (1 | N, 1 | Q, 1 | K)
            out |= ~m if m.dtype == torch.bool else excluded_by_additive_mask(m)
        return out


def valid_query_rows(excluded: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """The query rows of self-attention that are real tokens, (N, T) bool (True = valid).

    excluded: (N, T, T), True where the kernel excludes key j from query row i (one head).
    attention_mask: the model's own padding mask (N, T) (nonzero / True = token), or None.

    The model's mask decides when it describes this kernel's sequence: every key it marks as
    padding is excluded from every row it marks as a token, and from its own row unless that
    row attends to every key (Hugging Face lets fully masked rows attend to everything, or
    nothing). A mask of another sequence of the same length (an encoder's, seen by a causal
    decoder) fails that test. Otherwise, from the kernel alone: a position is padding when it
    is excluded as a key from every query row.
    """
    if attention_mask is not None and attention_mask.shape == excluded.shape[:2]:
        pad = attention_mask == 0  # (N, T)
        in_valid_rows = (excluded | pad[:, :, None]).all(1)  # (N, T): key j excluded in every token row
        own_row = excluded.diagonal(dim1=1, dim2=2) | (~excluded).all(-1)  # row j excludes key j, or is open
        agrees = (~pad | (in_valid_rows & own_row)).all()  # no host read: both answers, one chosen on the device
        return torch.where(agrees, ~pad, ~excluded.all(1))
    return ~excluded.all(1)


def _row_chunks(n_rows: int, n_heads: int, n_keys: int) -> int:
    return max(1, min(n_rows, _CHUNK_BYTES // max(1, 8 * n_heads * n_keys)))


def spread_rows(n: int, k: int) -> list[int]:
    """``k`` of the indices ``0 .. n - 1`` spread evenly from the first to the last (all of them when ``n <= k``):
    the rows the attention rank reads."""
    if n <= k:
        return list(range(n))
    if k == 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def spread_positions(valid: Tensor | None, n: int, k: int, device: torch.device | str, centred: bool = False
                     ) -> tuple[Tensor, Tensor]:
    """``k`` of the token rows of a sequence, spread through it, found on the device with no host read.

    valid: (n,) bool, True on token rows (None: every row is one). With ``m`` token rows, the ``j``-th entry is the
    token row :func:`spread_rows` picks (``round(j (m - 1) / (k - 1))``, from the first to the last: the rank's
    rows), or with ``centred`` the middle one of the ``j``-th of ``k`` equal strata (``floor((j + 1/2) m / k)``: a
    midpoint rule, the rows whose mean estimates the mean over every row). A sequence with at most ``k`` token rows
    takes every one. Returns ``(positions, live)`` of ``min(n, k)`` entries each: the row positions, ascending where
    live, and whether the entry is a row at all (the callers count a dead entry as a row with no key)."""
    width = min(n, k)
    if valid is None:
        valid = torch.ones(n, dtype=torch.bool, device=device)
    tokens = valid.sum()  # (): how many token rows
    j = torch.arange(width, dtype=torch.float64, device=device)
    if centred:
        spread = torch.floor((j + 0.5) * tokens.double() / k)
    elif k > 1:
        spread = torch.round(j * (tokens - 1).double() / (k - 1))  # as Python's round: half to even
    else:
        spread = torch.zeros_like(j)
    target = torch.where(tokens > k, spread, j).long()  # the target-th token row (0-based)
    live = target < tokens
    order = valid.long().cumsum(0)  # (n,): token rows up to and including each row
    positions = torch.searchsorted(order, target + 1).clamp_max(n - 1)
    return positions, live


def _singular_values(gram: Tensor) -> Tensor:
    """All singular values of each (R, K) probability block, descending, float64, from its Gram matrix (the
    smaller of P P^T and P^T P): the square roots of its eigenvalues, faster than ``svdvals``
    (docs/cost.md#implementation-choices) and exact enough for an effective rank. Eigenvalues below the Gram's
    rounding level (n eps lambda_1) are noise and count as 0, so a singular value under ~1e-7 sigma_1 reads as 0;
    effective ranks agree with ``svdvals`` to ~1e-7 relative (tests/math/test_math.py)."""
    energy = torch.linalg.eigvalsh(gram).flip(-1)
    floor = gram.shape[-1] * torch.finfo(gram.dtype).eps * energy[..., :1]
    return torch.where(energy > floor, energy, 0.0).sqrt()


def _gram(block: Tensor) -> Tensor:
    """The smaller Gram matrix of each (R, K) block: P P^T (R x R) or P^T P (K x K)."""
    return block @ block.transpose(-1, -2) if block.shape[-2] <= block.shape[-1] else block.transpose(-1, -2) @ block


@dataclass
class PendingRank:
    """The attention rank of one call, waiting for its eigenvalues: the Gram matrices of the rows the rank reads
    (S, H, m, m) float64 per sampled sequence and head (non-finite heads zeroed), ``finite`` (S, H) and
    ``counted`` (S,): the sequences that had a row to read. :func:`solve_ranks` finishes many at once."""

    grams: Tensor
    finite: Tensor
    counted: Tensor


# Bytes of Gram matrices solved in one eigvalsh call by solve_ranks; a capture holds at most about this much.
SOLVE_BYTES = 128 * 2**20


def solve_ranks(stats: list[AttentionStats], solve_bytes: int | None = None) -> None:
    """Fill in ``rank`` of every :class:`AttentionStats` whose rank is pending, in as few eigensolver calls as
    the Grams allow: one per Gram size and ``solve_bytes`` (128 MiB) of Grams, whatever the number of layers and
    captured calls (one call per sampled step for every model whose layers share a context length and fit the
    budget; a solver call on an accelerator synchronises with the host, docs/cost.md#host-synchronisation)."""
    budget = SOLVE_BYTES if solve_bytes is None else solve_bytes
    pending = [s for s in stats if s.pending is not None]
    by_size: dict[int, list[AttentionStats]] = {}
    for s in pending:
        by_size.setdefault(s.pending.grams.shape[-1], []).append(s)
    for group in by_size.values():
        batch: list[AttentionStats] = []
        held = 0
        for s in group + [None]:
            size = 0 if s is None else s.pending.grams.numel() * s.pending.grams.element_size()
            if batch and (s is None or held + size > budget):
                _solve(batch)
                batch, held = [], 0
            if s is not None:
                batch.append(s)
                held += size


def _solve(batch: list[AttentionStats]) -> None:
    grams = torch.cat([s.pending.grams.flatten(0, 1) for s in batch])  # (sum S*H, m, m)
    ranks = effective_rank(_singular_values(grams))
    at = 0
    for s in batch:
        p = s.pending
        n_seq, n_heads = p.grams.shape[:2]
        erank = torch.where(p.finite, ranks[at : at + n_seq * n_heads].reshape(n_seq, n_heads), torch.nan)
        at += n_seq * n_heads
        s.rank = torch.where(p.counted[:, None], erank, 0.0).sum(0) / p.counted.sum()
        s.pending = None


def _softmax_rows(chunk: Tensor, dead: Tensor | None, lazy: bool):
    """Per row of a (H, c, K) block of logits: float64 logits with excluded keys at -inf, log p and p (0 on
    excluded keys and on rows with no key), the keys each row may attend to, and the row's logsumexp.
    dead: (c,) True on rows that count as having no key (padding, or no row at all)."""
    excluded = excluded_by_additive_mask(chunk)  # in the logits' own dtype (its finfo.min)
    if dead is not None:
        excluded = excluded | dead[:, None]
    s = chunk.double()
    if not lazy or dead is not None:  # eager logits may carry a finite additive mask value
        s = s.masked_fill(excluded, -math.inf)
    keys = (~excluded).sum(-1)  # (H, c): keys each row may attend to
    lse = torch.where(keys > 0, torch.logsumexp(s, dim=-1), 0.0)  # 0 on rows with no key
    logp = s - lse[..., None]  # log p; -inf on excluded keys (and on whole rows with no key)
    return s, logp, logp.exp(), keys, lse


class _Rows:
    """Blocks of query rows of one sequence's logits, by a range or by positions."""

    def __init__(self, logits: Tensor | LazyLogits, i: int) -> None:
        self.logits, self.i = logits, i

    def at(self, rows: slice | Tensor) -> Tensor:
        if isinstance(self.logits, LazyLogits):
            return self.logits.rows_at(self.i, rows)
        return self.logits[self.i, :, rows]


def _max_logit(logits: Tensor | LazyLogits, i: int, valid: Tensor | None, step: int) -> Tensor:
    """(H,) the largest logit of sequence i over every valid row and allowed key, in the logits' own precision
    (float32 at least), a block of rows at a time: no float64 copy of the H x Q x K logits."""
    n_heads, n_q = logits.shape[1], logits.shape[2]
    dev = logits.q.device if isinstance(logits, LazyLogits) else logits.device
    best = torch.full((n_heads,), -math.inf, dtype=torch.float64, device=dev)
    for start in range(0, n_q, step):
        rows = slice(start, start + step)
        if isinstance(logits, LazyLogits):  # causal: the keys after the block's last row are excluded from all of it
            keys = min(start + step, logits.shape[3]) if logits.is_causal else None
            chunk = logits.rows_at(i, rows, dtype=torch.promote_types(logits.q.dtype, torch.float32), keys=keys)
        else:
            chunk = logits[i, :, rows]
        excluded = excluded_by_additive_mask(chunk)  # in the logits' own dtype (its finfo.min)
        chunk = chunk.float() if chunk.element_size() < 4 else chunk
        if valid is not None:
            excluded = excluded | ~valid[rows, None]
        best = torch.maximum(best, chunk.masked_fill(excluded, -math.inf).amax(dim=(-1, -2)).double())
    return best


def stats_from_logits(
    logits: Tensor | LazyLogits, rank_rows: int = 256, query_valid: Tensor | None = None,
    entropy_rows: int | None = None, solve: bool = True,
) -> AttentionStats:
    """Entropy (nats, mean over valid rows), effective rank, max logit and sink share per head.

    logits: (N, H, Q, K) as fed to the softmax; excluded keys are -inf or carry a
    large negative additive mask (see :func:`excluded_by_additive_mask`); or a
    :class:`LazyLogits`, read a block of rows at a time (the same numbers).
    query_valid: (N, Q) bool, False on padded query rows: they count for nothing
    (as rows with no key do), and the rank reads ``rank_rows`` of the rows that are True,
    spread through the sequence.
    entropy_rows: when a sequence has more query rows than this, the entropy, the uniform entropy and the
    sink share are the means over ``entropy_rows`` of its token rows, the middle row of each of that many equal
    strata of them (:func:`spread_positions`), and the max logit is taken over every row in the logits' own
    precision (float32 at least) instead of float64: the float64 work then grows as entropy_rows x K instead of
    Q x K (docs/metrics.md#attention-at-long-context states the error). None: every row, in float64.
    solve: False leaves the rank pending (``pending``), for :func:`solve_ranks` to finish with other calls'.
    No host read: every branch on the data is a ``torch.where``.
    """
    n_seq, n_heads, n_q, n_k = logits.shape
    lazy = isinstance(logits, LazyLogits)  # its excluded entries are -inf already
    dev = logits.q.device if lazy else logits.device
    zeros = lambda: torch.zeros(n_heads, dtype=torch.float64, device=dev)  # noqa: E731
    ent_sum, uniform_sum, rows = zeros(), zeros(), zeros()
    max_logit = torch.full((n_heads,), -math.inf, dtype=torch.float64, device=dev)
    share_sum = torch.zeros(n_heads, n_k, dtype=torch.float64, device=dev)  # (H, K): key shares, summed over seqs
    share_seqs = zeros()
    step = _row_chunks(n_q, n_heads, n_k)
    subsample = entropy_rows is not None and n_q > entropy_rows
    map_block: list[Tensor] = []
    grams, finite, counted, seen_rows = [], [], [], []
    for i in range(n_seq):
        seq = _Rows(logits, i)
        valid = None if query_valid is None else query_valid[i]
        column = torch.zeros(n_heads, n_k, dtype=torch.float64, device=dev)  # (H, K): this sequence's key mass
        seq_rows = zeros()
        rank_at, rank_live = spread_positions(valid, n_q, rank_rows, dev)
        rank_block = None
        if subsample:
            at, live = spread_positions(valid, n_q, entropy_rows, dev, centred=True)
            blocks = [(at[a : a + step], live[a : a + step]) for a in range(0, at.shape[0], step)]
        else:
            blocks = [(slice(a, a + step), None) for a in range(0, n_q, step)]
        for where, live in blocks:
            dead = None if valid is None else ~valid[where]
            if live is not None:
                dead = ~live if dead is None else dead | ~live
            s, logp, p, keys, lse = _softmax_rows(seq.at(where), dead, lazy)
            valid_row = keys > 0
            # 0 * -inf = NaN on excluded keys: nansum skips them. A non-finite logit makes lse non-finite.
            row_ent = torch.where(torch.isfinite(lse), -torch.nansum(p * logp, dim=-1), torch.nan)  # (H, c)
            ent_sum += row_ent.sum(-1)
            uniform_sum += keys.clamp_min(1).double().log().sum(-1)
            rows += valid_row.sum(-1)
            seq_rows += valid_row.sum(-1)
            column += p.sum(-2)
            if not subsample:
                max_logit = torch.maximum(max_logit, s.amax(dim=(-1, -2)))
                if i == 0 and where.start < MAP_SIZE:
                    map_block.append(p[:, : MAP_SIZE - where.start, :MAP_SIZE].float())
                if len(blocks) == 1:  # every row is in this block: the rank's rows are among them
                    rank_block = p[:, rank_at]
        if subsample:
            max_logit = torch.maximum(max_logit, _max_logit(logits, i, valid, step))
            if i == 0:
                first = slice(0, MAP_SIZE)
                dead = None if valid is None else ~valid[first]
                map_block.append(_softmax_rows(seq.at(first), dead, lazy)[2][..., :MAP_SIZE].float())
        has_share = seq_rows > 0  # (H,): a sequence with no valid row holds no share
        share_sum += torch.where(has_share[:, None], column / seq_rows.clamp_min(1)[:, None], 0.0)
        share_seqs += has_share
        # The rank's rows of this sequence: those of the block when one block held every row, else read again.
        if rank_block is None:
            dead = None if valid is None else ~valid[rank_at]
            rank_block = _softmax_rows(seq.at(rank_at), dead, lazy)[2]
        if valid is not None:  # entries past a sequence's token rows are dead: zero rows (none without padding)
            rank_block = torch.where(rank_live[None, :, None], rank_block, 0.0)  # (H, R, K)
        seen = (rank_block[0] > 0).any(-1).sum()
        gram = _gram(rank_block)
        ok = torch.isfinite(gram).flatten(1).all(1)  # (H,): a NaN head gets a NaN rank (its Gram is not finite)
        grams.append(torch.where(ok[:, None, None], gram, 0.0))
        finite.append(ok)
        counted.append(seen > 0)  # a sequence with no valid row among the rank's has no rank
        seen_rows.append(seen)
        del rank_block
    share = share_sum / share_seqs[:, None]  # (H, K): NaN for a head with no valid row anywhere
    sink, sink_pos = share.max(dim=-1)
    counted_t = torch.stack(counted)
    stats = AttentionStats(
        entropy=ent_sum / rows,
        rank=None,
        max_logit=max_logit,
        rows=(torch.stack(seen_rows).double().sum() / counted_t.sum()).reshape(1),
        uniform_entropy=uniform_sum / rows,
        sink=sink,
        sink_pos=sink_pos.double(),
        maps=torch.cat(map_block, dim=1) if map_block else None,
        pending=PendingRank(torch.stack(grams), torch.stack(finite), counted_t),
    )
    if solve:
        solve_ranks([stats])
    return stats


def stats_from_probabilities_reference(
    probs: Tensor, allowed: Tensor, rank_rows: int = 256, query_valid: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Slow reference from explicit probabilities (N, H, Q, K) and allowed keys (N, Q, K).

    Per-head loops in float64: entropy = mean over valid rows of -sum p log p;
    rank = mean over sequences of the effective rank of rank_rows rows spread through the sequence.
    query_valid (N, Q): rows marked False (padding) are dropped first, from both.
    """
    n_seq, n_heads, n_q, _ = probs.shape
    if query_valid is not None:
        allowed = allowed & query_valid[:, :, None]
    entropy = torch.zeros(n_heads, dtype=torch.float64)
    rank = torch.zeros(n_heads, dtype=torch.float64)
    for h in range(n_heads):
        total, count, ranks = 0.0, 0, []
        for i in range(n_seq):
            p_rows = []
            for r in range(n_q):
                if query_valid is not None and not bool(query_valid[i, r]):
                    continue  # padding: not a row of this sequence's attention
                if not bool(allowed[i, r].any()):
                    p_rows.append(torch.zeros(probs.shape[-1], dtype=torch.float64))
                    continue
                p = probs[i, h, r].double() * allowed[i, r]
                p_rows.append(p)
                nz = p[p > 0]
                total += float(-(nz * nz.log()).sum())
                count += 1
            spread = spread_rows(len(p_rows), rank_rows)
            mat = torch.stack(p_rows)[spread] if p_rows else torch.zeros(1, probs.shape[-1])
            if not bool((mat > 0).any()):
                continue  # no valid row in the block: this sequence has no rank
            sv = torch.linalg.svdvals(mat)
            pn = sv / sv.sum()
            pn = pn[pn > 0]
            ranks.append(math.exp(float(-(pn * pn.log()).sum())))
        entropy[h] = total / count if count else math.nan
        rank[h] = sum(ranks) / len(ranks) if ranks else math.nan
    return entropy, rank


def sink_reference(probs: Tensor, allowed: Tensor, query_valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Slow reference of ``attn_sink`` and ``attn_sink_pos`` from explicit probabilities (N, H, Q, K) and allowed
    keys (N, Q, K): per head and sequence, each key's probability averaged over the rows that have a key (and are
    not padding); those averages averaged over the sequences; the largest, and its key, by loops in float64."""
    n_seq, n_heads, n_q, n_k = probs.shape
    sink = torch.zeros(n_heads, dtype=torch.float64)
    pos = torch.zeros(n_heads, dtype=torch.float64)
    for h in range(n_heads):
        shares = [0.0] * n_k
        seqs = 0
        for i in range(n_seq):
            rows = [r for r in range(n_q) if bool(allowed[i, r].any())
                    and (query_valid is None or bool(query_valid[i, r]))]
            if not rows:
                continue
            seqs += 1
            for j in range(n_k):
                shares[j] += sum(float(probs[i, h, r, j]) * bool(allowed[i, r, j]) for r in rows) / len(rows)
        best = max(range(n_k), key=lambda j: shares[j])
        sink[h] = shares[best] / seqs if seqs else math.nan
        pos[h] = best
    return sink, pos
