"""Best-first order over items whose exact bound is costly: ``best_first`` yields items by a full bound
(a cheap part plus a costly part) while computing the costly part only for items that reach the front
of the queue, in the order a sort by the full bound gives. The joint search (``autopar.planner.joint``)
visits its (grouping, micro-batch count) items this way: the split bound is cheap, the tail bound
(stage all-reduces, optimizer steps) is not.

Terms
- cheap bound: a lower bound of the full bound (here the part the full bound adds to it is >= 0).
- limit: the bound above which no item is wanted any more; read again before every pop (the search
  lowers it as it finds better candidates).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

__all__ = ["best_first"]


def best_first(items: Iterable[tuple], extra: Callable[..., float], limit: Callable[[], float]) -> Iterator[tuple]:
    """``(cheap bound, *key)`` items in, ``(full bound, *key)`` out in ascending ``(full, *key)`` order,
    where full = cheap + ``extra(*key)`` (``extra`` >= 0, called at most once per item and only for
    items whose cheap bound is within the limit when they come first); stops at the first item whose
    bound exceeds ``limit()``. The same sequence as sorting by the full bound and stopping there: an
    item comes out only when its full key is below every cheap key left, and cheap <= full."""
    heap = [(bound, *key, False) for bound, *key in items]
    heapq.heapify(heap)
    while heap:
        bound, *key, full = heapq.heappop(heap)
        if bound > limit():
            return
        if not full:
            heapq.heappush(heap, (bound + extra(*key), *key, True))
            continue
        yield (bound, *key)
