"""Which batch shapes get a CUDA graph, and which captured shape a batch replays in: pure
policy (policy/shape_classes.py), checked from counts alone."""

from __future__ import annotations

import pytest

from worker.policy.shape_classes import (
    batch_classes,
    decode_classes,
    decode_rows,
    prefill_classes,
    rows_cap,
    shape_classes,
)


def test_classes_are_powers_of_two_with_half_steps_from_eight_up_to_the_cap() -> None:
    assert batch_classes(512) == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384,
                                  512)
    assert batch_classes(8) == (1, 2, 4, 8)
    assert batch_classes(1) == (1,)


def test_a_cap_that_is_no_class_is_a_class_itself() -> None:
    assert batch_classes(341)[-3:] == (192, 256, 341)
    assert batch_classes(5) == (1, 2, 4, 5)
    assert batch_classes(0) == (1,)  # a batch always holds one row


def test_the_token_budget_caps_the_rows_of_long_buckets() -> None:
    assert rows_cap(16, 512, 65_536) == 512
    assert rows_cap(256, 512, 65_536) == 256
    assert rows_cap(10_000, 512, 8192) == 1
    classes = shape_classes([16, 256], 512, 65_536)
    assert [(length, rows[-1]) for length, rows in classes.classes] == [(16, 512), (256, 256)]


def test_a_batch_runs_in_the_smallest_shape_that_holds_it() -> None:
    classes = shape_classes([16, 32, 64], 32, 8192)
    assert classes.fit(1, 16) == (1, 16)
    assert classes.fit(3, 16) == (4, 16)  # rows padded to the class
    assert classes.fit(9, 17) == (12, 32)  # tokens padded to the bucket length
    assert classes.fit(32, 64) == (32, 64)
    assert classes.fit(20, 5) == (24, 16)


@pytest.mark.parametrize("rows, length", [(33, 16), (1, 65), (0, 16), (4, 0), (200, 60)])
def test_a_batch_no_shape_holds_runs_eagerly(rows: int, length: int) -> None:
    assert shape_classes([16, 32, 64], 32, 8192).fit(rows, length) is None


def test_shapes_are_captured_largest_first_once_each() -> None:
    classes = shape_classes([32, 16, 16], 4, 8192)  # unsorted, repeated boundaries
    assert [length for length, _ in classes.classes] == [16, 32]
    assert classes.shapes == [(4, 32), (4, 16), (2, 32), (2, 16), (1, 32), (1, 16)]


def test_no_boundaries_no_shapes() -> None:
    classes = shape_classes([], 32, 8192)
    assert classes.shapes == [] and classes.fit(1, 8) is None


def test_decode_rows_are_powers_of_two_then_the_cap() -> None:
    assert decode_rows(64) == (1, 2, 4, 8, 16, 32, 64)
    assert decode_rows(48) == (1, 2, 4, 8, 16, 32, 48)
    assert decode_rows(1) == (1,)


def test_decode_lengths_double_from_256_up_to_the_context_or_4096() -> None:
    classes = decode_classes(max_seqs=4, max_context=8192)
    assert [length for length, _ in classes.classes] == [256, 512, 1024, 2048, 4096]
    assert all(rows == (1, 2, 4) for _, rows in classes.classes)
    assert [length for length, _ in decode_classes(4, 1000).classes] == [256, 512, 1000]
    assert [length for length, _ in decode_classes(4, 100).classes] == [100]


def test_a_decode_step_fits_the_smallest_class_and_a_longer_one_runs_eagerly() -> None:
    classes = decode_classes(max_seqs=64, max_context=2048)
    assert classes.fit(3, 17) == (4, 256)
    assert classes.fit(33, 300) == (64, 512)
    assert classes.fit(64, 2048) == (64, 2048)
    assert classes.fit(65, 10) is None and classes.fit(2, 2049) is None


def test_prefill_key_classes_double_from_64_each_with_the_query_classes_it_holds() -> None:
    classes = prefill_classes(max_step_tokens=512, max_context=8192)
    assert classes.classes == (
        (64, (64,)), (128, (64, 128)), (256, (64, 128, 256)), (512, (64, 128, 256, 512)),
        (1024, (64, 128, 256, 512)), (2048, (64, 128, 256, 512)), (4096, (64, 128, 256, 512)))
    assert prefill_classes(100, 300).classes == (
        (64, (64,)), (128, (64, 100)), (256, (64, 100)), (300, (64, 100)))


def test_a_packed_prefill_fits_its_queries_and_keys_and_a_larger_one_runs_eagerly() -> None:
    classes = prefill_classes(max_step_tokens=512, max_context=2048)
    assert classes.fit(30, 31) == (64, 64)  # first chunks: as many keys as queries
    assert classes.fit(300, 301) == (512, 512)
    assert classes.fit(200, 1500) == (256, 2048)  # a long prompt's later chunk
    assert classes.fit(513, 600) is None and classes.fit(10, 2049) is None
