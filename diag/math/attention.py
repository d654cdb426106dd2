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
    "stats_from_probabilities_reference",
]

# Bytes of float64 logits processed at once per sequence; bounds the capture's memory.
_CHUNK_BYTES = 32 * 2**20


@dataclass
class AttentionStats:
    """Per-head results, each a float64 tensor of shape (H,)."""

    entropy: Tensor
    rank: Tensor
    max_logit: Tensor
    rows: Tensor  # (1,): valid query rows per sequence that the rank saw (mean over sequences)
    uniform_entropy: Tensor  # (H,): the entropy uniform attention over the same valid keys would have
    sink: Tensor  # (H,): the largest share of the queries' mass on one key position (mean over sequences)
    sink_pos: Tensor  # (H,): that key's position (float64, a whole number)
    # (H, R, C) float32: the attention probabilities of the first sampled sequence, its first
    # R <= MAP_SIZE query rows over its first C <= MAP_SIZE keys (for images of flagged heads).
    maps: Tensor | None = None


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
        self._keys: tuple[int, Tensor] | None = None

    def rows(self, i: int, start: int, stop: int) -> Tensor:
        """Float64 logits (H, stop - start, K) of sequence i; excluded entries are -inf."""
        n_heads, n_kv = self.shape[1], self.k.shape[1]
        if self._keys is None or self._keys[0] != i:
            self._keys = (i, self.k[i].double())  # (G, K, D): one sequence's keys, not repeated per query head
        q = self.q[i, :, start:stop].double()  # (H, c, D); query head h pairs with key head h // (H / G)
        rows = q.shape[1]
        logits = q.reshape(n_kv, n_heads // n_kv, rows, q.shape[-1]) @ self._keys[1][:, None].transpose(-1, -2)
        logits = logits.reshape(n_heads, rows, self.shape[3]) * self.scale
        if self.is_causal:
            row = torch.arange(start, start + logits.shape[1], device=logits.device)[:, None]
            logits = logits.masked_fill(torch.arange(self.shape[3], device=logits.device) > row, -math.inf)
        for mask in self.masks:
            m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
            m = m[i if m.shape[0] > 1 else 0, :, slice(start, stop) if m.shape[2] > 1 else slice(None)]
            if m.dtype == torch.bool:
                logits = logits.masked_fill(~m, -math.inf)
            else:
                logits = (logits + m.double()).masked_fill(excluded_by_additive_mask(m), -math.inf)
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
        if bool((~pad | (in_valid_rows & own_row)).all()):
            return ~pad
    return ~excluded.all(1)


def _row_chunks(n_rows: int, n_heads: int, n_keys: int) -> int:
    return max(1, min(n_rows, _CHUNK_BYTES // max(1, 8 * n_heads * n_keys)))


def _singular_values(p: Tensor) -> Tensor:
    """All singular values of each (R, K) probability block, descending, float64, as the square roots of
    the eigenvalues of the smaller Gram matrix: faster than ``svdvals`` (docs/cost.md#implementation-choices),
    and exact enough for an effective rank. Eigenvalues below the Gram's rounding level (n eps lambda_1) are
    noise and count as 0, so a singular value under ~1e-7 sigma_1 reads as 0; effective ranks agree with
    ``svdvals`` to ~1e-7 relative (tests/math/test_math.py)."""
    gram = p @ p.transpose(-1, -2) if p.shape[-2] <= p.shape[-1] else p.transpose(-1, -2) @ p
    energy = torch.linalg.eigvalsh(gram).flip(-1)
    floor = gram.shape[-1] * torch.finfo(gram.dtype).eps * energy[..., :1]
    return torch.where(energy > floor, energy, 0.0).sqrt()


def spread_rows(n: int, k: int) -> list[int]:
    """``k`` of the indices ``0 .. n - 1`` spread evenly from the first to the last (all of them when ``n <= k``):
    the rows the attention rank reads."""
    if n <= k:
        return list(range(n))
    if k == 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _rank_rows(query_valid: Tensor | None, i: int, n_q: int, rank_rows: int) -> list[int]:
    """The query rows of sequence i the rank reads, ascending: ``rank_rows`` of its token rows spread through
    the sequence (:func:`spread_rows`). One host sync per sequence, only when rows are masked."""
    if query_valid is None:
        return spread_rows(n_q, rank_rows)
    tokens = query_valid[i].nonzero().flatten().tolist()
    return [tokens[j] for j in spread_rows(len(tokens), rank_rows)]


def stats_from_logits(
    logits: Tensor | LazyLogits, rank_rows: int = 256, query_valid: Tensor | None = None
) -> AttentionStats:
    """Entropy (nats, mean over valid rows), effective rank, max logit and sink share per head.

    logits: (N, H, Q, K) as fed to the softmax; excluded keys are -inf or carry a
    large negative additive mask (see :func:`excluded_by_additive_mask`); or a
    :class:`LazyLogits`, read a block of rows at a time (the same numbers).
    query_valid: (N, Q) bool, False on padded query rows: they count for nothing
    (as rows with no key do), and the rank reads ``rank_rows`` of the rows that are True,
    spread through the sequence.
    """
    n_seq, n_heads, n_q, n_k = logits.shape
    lazy = isinstance(logits, LazyLogits)  # its excluded entries are -inf already
    dev = logits.q.device if lazy else logits.device
    rows_of = logits.rows if lazy else (lambda i, a, b: logits[i, :, a:b])
    zeros = lambda: torch.zeros(n_heads, dtype=torch.float64, device=dev)  # noqa: E731
    ent_sum, uniform_sum, rows, rank_sum = zeros(), zeros(), zeros(), zeros()
    max_logit = torch.full((n_heads,), -math.inf, dtype=torch.float64, device=dev)
    share_sum = torch.zeros(n_heads, n_k, dtype=torch.float64, device=dev)  # (H, K): key shares, summed over seqs
    share_seqs = zeros()
    step = _row_chunks(n_q, n_heads, n_k)
    map_block: list[Tensor] = []
    rank_rows_seen = torch.zeros(1, dtype=torch.float64, device=dev)
    rank_seqs = torch.zeros(1, dtype=torch.float64, device=dev)
    for i in range(n_seq):
        rank_block = []
        take = _rank_rows(query_valid, i, n_q, rank_rows)  # R ascending row indices
        column = torch.zeros(n_heads, n_k, dtype=torch.float64, device=dev)  # (H, K): this sequence's key mass
        seq_rows = zeros()
        for start in range(0, n_q, step):
            chunk = rows_of(i, start, start + step)  # (H, c, K)
            excluded = excluded_by_additive_mask(chunk)  # in the logits' own dtype (its finfo.min)
            if query_valid is not None:  # a padded query row: as if it had no key
                excluded = excluded | ~query_valid[i, start : start + step, None]
            s = chunk.double()
            if not lazy or query_valid is not None:  # eager logits may carry a finite additive mask value
                s = s.masked_fill(excluded, -math.inf)
            keys = (~excluded).sum(-1)  # (H, c): keys each row may attend to
            valid_row = keys > 0
            lse = torch.where(valid_row, torch.logsumexp(s, dim=-1), 0.0)  # 0 on rows with no key
            logp = s - lse[..., None]  # log p; -inf on excluded keys (and on whole rows with no key)
            p = logp.exp()  # (H, c, K); 0 on excluded keys and on rows with no key
            # 0 * -inf = NaN on excluded keys: nansum skips them. A non-finite logit makes lse non-finite.
            row_ent = torch.where(torch.isfinite(lse), -torch.nansum(p * logp, dim=-1), torch.nan)  # (H, c)
            ent_sum += row_ent.sum(-1)
            uniform_sum += keys.clamp_min(1).double().log().sum(-1)
            rows += valid_row.sum(-1)
            seq_rows += valid_row.sum(-1)
            column += p.sum(-2)
            max_logit = torch.maximum(max_logit, s.amax(dim=(-1, -2)))
            local = [r - start for r in take if start <= r < start + p.shape[1]]
            if local:
                rank_block.append(p[:, local])
            if i == 0 and start < MAP_SIZE:
                map_block.append(p[:, : MAP_SIZE - start, :MAP_SIZE].float())
        has_share = seq_rows > 0  # (H,): a sequence with no valid row holds no share
        share_sum += torch.where(has_share[:, None], column / seq_rows.clamp_min(1)[:, None], 0.0)
        share_seqs += has_share
        # The rank of this sequence now, so that one sequence's rows are held at a time.
        if not rank_block:  # no token row at all
            rank_block = [torch.zeros(n_heads, 1, n_k, dtype=torch.float64, device=dev)]
        block = rank_block[0] if len(rank_block) == 1 else torch.cat(rank_block, dim=1)  # (H, R, K)
        del rank_block
        seen = (block[0] > 0).any(-1).sum()
        has_rows = seen > 0  # a sequence with no valid row in the block has no rank
        finite = torch.isfinite(block).flatten(1).all(1)  # (H,): a NaN head gets a NaN rank
        if not bool(finite.all()):
            block = torch.where(finite[:, None, None], block, 0.0)
        erank = torch.where(finite, effective_rank(_singular_values(block)), torch.nan)
        rank_sum += torch.where(has_rows, erank, 0.0)
        rank_rows_seen += seen
        rank_seqs += has_rows
    share = share_sum / share_seqs[:, None]  # (H, K): NaN for a head with no valid row anywhere
    sink, sink_pos = share.max(dim=-1)
    return AttentionStats(
        entropy=ent_sum / rows,
        rank=rank_sum / rank_seqs,
        max_logit=max_logit,
        rows=rank_rows_seen / rank_seqs,
        uniform_entropy=uniform_sum / rows,
        sink=sink,
        sink_pos=sink_pos.double(),
        maps=torch.cat(map_block, dim=1) if map_block else None,
    )


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
