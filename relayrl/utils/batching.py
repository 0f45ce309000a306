"""Grouping sequences of different lengths so that padding them together wastes little."""

from __future__ import annotations


def length_groups(lengths: list[int], waste: float = 0.25) -> list[list[int]]:
    """Indices of ``lengths`` in groups of similar length, shortest first.

    Lengths are sorted; a group grows while its padded size (longest x count) stays within
    ``1 + waste`` times its real tokens. One padded call per group then replaces one call
    per sequence (per-call overhead) or one call over everything padded to the longest
    (padding compute): LocalEngine prefills, per-document attention in training.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups: list[list[int]] = [[]]
    real = 0
    for i in order:
        n = lengths[i]
        if groups[-1] and n * (len(groups[-1]) + 1) > (1 + waste) * (real + n):
            groups.append([])
            real = 0
        groups[-1].append(i)
        real += n
    return groups
