"""prefetched: order, errors raised in the consumer, and no thread left behind."""

from __future__ import annotations

import threading

import pytest

from batchgen.job.prefetch import prefetched


def prefetch_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "batchgen-prefetch"]


def test_items_come_out_in_order_computed_at_most_one_ahead():
    computed = []

    def items():
        for number in range(50):
            computed.append(number)
            yield number

    for number in prefetched(items()):
        assert len(computed) <= number + 3  # this one, one waiting, one being computed
    assert computed == list(range(50))


def test_an_error_of_the_iteration_is_raised_in_the_consumer_after_the_items_before_it():
    def items():
        yield 1
        yield 2
        raise ValueError("row 3 is broken")

    seen = []
    with pytest.raises(ValueError, match="row 3 is broken"):
        for item in prefetched(items()):
            seen.append(item)
    assert seen == [1, 2] and not prefetch_threads()


def test_a_consumer_that_stops_early_ends_the_thread():
    generator = prefetched(iter(range(1000)))
    assert next(generator) == 0
    generator.close()
    assert not prefetch_threads()
