"""builder/read_ahead.py: the pack phase's next module is produced while the caller writes the current one,
in order, with at most two modules alive, a module over the byte budget handed over alone, a producer's
error raised at its item, and nothing left running when the caller stops early."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from ifb.builder.read_ahead import read_ahead

NOT_ASKED_S = 0.3  # how long a request that must not come is waited for


class Source:
    """Items 0..n-1 of the given sizes; `asked[i]` is set when item i is asked for."""

    def __init__(self, sizes: list[int], fail_at: int | None = None) -> None:
        self.sizes, self.fail_at = sizes, fail_at
        self.asked = [threading.Event() for _ in range(len(sizes) + 1)]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for index, size in enumerate(self.sizes):
            self.asked[index].set()
            if index == self.fail_at:
                raise ValueError(f"item {index} cannot be read")
            yield index, size
        self.asked[len(self.sizes)].set()


def ahead(source: Source, budget: int = 100) -> Iterator[tuple[int, int]]:
    return read_ahead(iter(source), lambda item: item[1], budget)


def test_items_come_in_order_and_the_next_is_produced_while_one_is_held() -> None:
    source = Source([10] * 5)
    items = ahead(source)
    assert next(items) == (0, 10)
    assert source.asked[1].wait(10)  # produced while the caller holds item 0
    assert not source.asked[2].wait(NOT_ASKED_S)  # but no further: two modules alive at most
    assert list(items) == [(i, 10) for i in range(1, 5)]


def test_an_item_over_the_budget_is_handed_over_alone() -> None:
    source = Source([10, 500, 10, 10])
    items = ahead(source)
    assert next(items) == (0, 10)
    assert next(items) == (1, 500)
    assert not source.asked[2].wait(NOT_ASKED_S)  # nothing produced beside the big one
    assert next(items) == (2, 10)
    assert source.asked[3].wait(10)
    assert list(items) == [(3, 10)]


def test_a_producer_error_is_raised_at_its_item() -> None:
    items = ahead(Source([10, 10, 10, 10], fail_at=2))
    assert next(items) == (0, 10)
    assert next(items) == (1, 10)
    with pytest.raises(ValueError, match="item 2 cannot be read"):
        next(items)


@pytest.mark.parametrize("sizes", [[10, 10, 10], [500, 500, 500]])
def test_stopping_early_leaves_no_thread(sizes: list[int]) -> None:
    items = ahead(Source(sizes))
    assert next(items) == (0, sizes[0])
    items.close()  # as a caller's exception (a failed write) ends the for loop
    assert not [t for t in threading.enumerate() if t.name == "ifb-read-ahead"]
