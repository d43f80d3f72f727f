"""The length mix of ``bench_items``: token counts of a realistic corpus, with a fixed seed.

Lengths are lognormal: median 40 tokens, sigma 0.82 (p90 about 2.9x the median, as
sentence and paragraph corpora are), rounded, at least 1 and clipped at 384, the tail
that a model's maximum length cuts. With the default seed, 4,096 lengths have median
39, p90 112, p99 267, mean 54.8, and 12 at 384 (224,477 tokens in all). Token ids are drawn uniformly from the words of
the benchmark's vocabulary, between ``[CLS]`` and ``[SEP]``, so the texts and the ids
are the same items.

Run ``python benchmarks/_item_lengths.py`` to print the mix's figures.

Example:
    >>> ls = lengths(4096)
    >>> len(ls), min(ls) >= 1, max(ls)
    (4096, True, 384)
    >>> describe(ls)["median"], describe(ls)["at_longest"]
    (39.0, 12)
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

__all__ = ["CLS", "LONGEST", "MEDIAN", "SEP", "SIGMA", "WORDS_AT", "describe", "lengths", "texts", "token_ids"]

MEDIAN, SIGMA, LONGEST, SEED = 40, 0.82, 384, 0
PAD, CLS, SEP, WORDS_AT = 0, 2, 3, 5  # [PAD], [UNK], [CLS], [SEP], [MASK], then the words


def lengths(n: int = 4096, seed: int = SEED) -> list[int]:
    """``n`` token counts (``[CLS]`` and ``[SEP]`` included) from the mix."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g, dtype=torch.float64)
    counts = (math.log(MEDIAN) + SIGMA * z).exp().round().clamp(1, LONGEST)
    return [int(c) for c in counts]


def token_ids(counts: list[int], vocab: int, seed: int = SEED) -> list[torch.Tensor]:
    """One 1-D tensor of ids per count: ``[CLS]``, ``count - 2`` words (at least one), ``[SEP]``."""
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for n in counts:
        words = torch.randint(WORDS_AT, vocab, (max(1, n - 2),), generator=g)
        out.append(torch.cat([torch.tensor([CLS]), words, torch.tensor([SEP])]))
    return out


def texts(ids: list[torch.Tensor]) -> list[str]:
    """The texts whose tokens are ``ids`` in the benchmark's vocabulary (word ``w{i}`` is id ``WORDS_AT + i``)."""
    return [" ".join(f"w{int(t) - WORDS_AT}" for t in row[1:-1]) for row in ids]


def vocabulary(vocab: int) -> list[str]:
    """The benchmark's vocabulary: BERT's five special tokens, then the words."""
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(vocab - WORDS_AT))]


def describe(counts: list[int]) -> dict[str, Any]:
    """Median, p90, p99, max, mean and total of the counts."""
    xs = sorted(counts)

    def q(p: float) -> float:
        return float(xs[min(len(xs) - 1, round(p * (len(xs) - 1)))])

    return {"n": len(xs), "median": float(statistics.median(xs)), "p90": q(0.9), "p99": q(0.99),
            "max": xs[-1], "mean": statistics.fmean(xs), "total": sum(xs),
            "at_longest": sum(1 for x in xs if x == LONGEST)}


if __name__ == "__main__":
    print(describe(lengths()))
