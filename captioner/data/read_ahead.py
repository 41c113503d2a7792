"""Reading images ahead of the model, torch-free (the torch `Captioner` and the ONNX `LiteCaptioner`
both use it): decoding the next images overlaps with captioning these (Pillow, torch and ONNX
Runtime release the GIL)."""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from captioner.data.images import ImageError

Item = TypeVar("Item")


def read_ahead(read: Callable[[Item], Any], items: Iterable[Item], ahead: int,
               threads: int = 1) -> Iterator[tuple[Item, Any]]:
    """(item, read(item) or the ImageError it raised) for each item, in order, read on `threads`
    loader threads at most `ahead` items in advance. A single item is read here: no thread to start."""
    items = iter(items)
    head = list(itertools.islice(items, 2))
    if len(head) == 1:
        try:
            yield head[0], read(head[0])
        except ImageError as e:
            yield head[0], e
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="captioner-load") as pool:
        pending: deque[tuple[Item, Future]] = deque()
        for item in itertools.chain(head, items):
            pending.append((item, pool.submit(read, item)))
            if len(pending) > ahead:
                yield _result(*pending.popleft())
        while pending:
            yield _result(*pending.popleft())


def _result(item: Item, future: Future) -> tuple[Item, Any]:
    try:
        return item, future.result()
    except ImageError as e:
        return item, e
