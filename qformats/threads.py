"""Independent host-side calls run side by side from a few threads (XLA computations release the GIL)."""

from __future__ import annotations

import concurrent.futures
from typing import Callable, Iterable, List, TypeVar

__all__ = ["each"]

T = TypeVar("T")
R = TypeVar("R")


def each(fn: Callable[[T], R], items: Iterable[T], workers: int) -> List[R]:
    """[fn(x) for x in items], the calls made by min(workers, len(items)) threads (in the calling thread for
    workers <= 1 or a single item); results in the items' order. The first exception (in the items' order) is
    raised here once every call has returned.

    Why: on XLA:CPU one computation leaves cores idle while its threads wait at the end of an op, or while the
    calling thread reads a result back; a second computation started from another thread fills them (the AWQ race,
    the GPTQ searches of a layer's projection groups)."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(min(workers, len(items))) as pool:
        return list(pool.map(fn, items))
