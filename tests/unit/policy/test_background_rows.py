"""Background requests (priority < 0, batch jobs' lines) beside online ones: a batch holds
at most `background_rows` of them while online requests keep arriving, and absorbs no
bucket holding any; once online traffic is quiet they batch as large as the limits allow.
Under a latency target their share of the time follows the online percentile."""

from __future__ import annotations

import pytest

from producer.protocol import MSGPACK
from producer.request_entry import Request
from worker.models.base import Prepared
from worker.policy.background import STEER_BACK, STEER_GROW, STEER_MS, STEER_ROOM, BackgroundPacing
from worker.policy.batching import Batcher, BatchLimits, Pending


def pending(n: int, priority: int, length: int = 4, at_ms: int = 1_000) -> Pending:
    request = Request(f"r{n}", b"", MSGPACK, "reply", None, priority)
    return Pending(f"{at_ms}-{n}", request, Prepared(length, None), read_at=0.0,
                   enqueued_ms=at_ms)


def batcher(rows: int = 2) -> Batcher:
    return Batcher([8], BatchLimits(16, 10_000, 0.0), merge_tokens=10_000,
                   background_rows=rows, background_quiet_ms=1000)


def test_while_online_requests_arrive_a_batch_holds_few_background_ones() -> None:
    b = batcher()
    for n in range(10):
        b.add(pending(n, -1))
    b.add(pending(99, 0))
    batch = b.next_batch(1.0, 1_500)
    assert batch is not None
    assert [p.request.priority for p in batch.members] == [0, -1, -1]
    again = b.next_batch(1.0, 1_500)  # background alone, still capped
    assert again is not None and len(again.members) == 2


def test_background_in_another_bucket_is_not_absorbed_while_capped() -> None:
    b = batcher()
    b.add(pending(1, 0, length=4))
    for n in range(5):
        b.add(pending(10 + n, -1, length=12))  # the other bucket
    batch = b.next_batch(1.0, 1_200)
    assert batch is not None and len(batch.members) == 1


def test_once_online_traffic_is_quiet_background_batches_are_full() -> None:
    b = batcher()
    b.add(pending(0, 0, at_ms=1_000))
    for n in range(20):
        b.add(pending(n + 1, -1, at_ms=1_000))
    assert b.next_batch(1.0, 1_100) is not None  # the online one, with 2 background
    batch = b.next_batch(1.0, 2_500)  # 1.5 s after the last online arrival
    assert batch is not None and len(batch.members) == 16


def test_no_cap_when_background_rows_is_zero() -> None:
    b = batcher(rows=0)
    b.add(pending(0, 0))
    for n in range(20):
        b.add(pending(n + 1, -1))
    batch = b.next_batch(1.0, 1_100)
    assert batch is not None and len(batch.members) == 16


def test_a_bucket_with_an_online_request_goes_before_an_older_background_one() -> None:
    b = batcher()
    for n in range(3):
        b.add(pending(n, -1, length=12, at_ms=900))  # older, background alone
    b.add(pending(9, 0, length=4, at_ms=1_000))
    batch = b.next_batch(1.0, 1_100)
    assert batch is not None and [p.request.priority for p in batch.members] == [0]


def paced(share: float) -> Batcher:
    return Batcher([8], BatchLimits(16, 10_000, 0.0), merge_tokens=10_000,
                   background_rows=2, background_quiet_ms=1000, background_share=share)


def test_batches_of_background_alone_take_their_share_of_the_time() -> None:
    b = paced(0.25)
    b.add(pending(0, 0, at_ms=1_000))
    for n in range(10):
        b.add(pending(n + 1, -1, at_ms=1_000))
    b.next_batch(1.0, 1_000)  # the online one, with 2 background
    alone = b.next_batch(1.0, 1_010)
    assert alone is not None and len(alone.members) == 2
    b.finished(alone, 20.0, 1_030)  # 20 ms of compute: 60 ms of rest at a share of 0.25
    assert b.next_batch(1.0, 1_050) is None
    assert b.seconds_until_ready(1.0, 1_050) == 0.04
    again = b.next_batch(1.0, 1_090)
    assert again is not None and len(again.members) == 2


def test_an_online_request_is_not_held_by_the_pacing() -> None:
    b = paced(0.25)
    for n in range(4):
        b.add(pending(n, -1, at_ms=1_000))
    b.add(pending(9, 0, at_ms=1_000))
    assert b.next_batch(1.0, 1_000) is not None  # the online one, with 2 background
    alone = b.next_batch(1.0, 1_000)
    assert alone is not None
    b.finished(alone, 100.0, 1_100)
    b.add(pending(10, 0, at_ms=1_110))
    batch = b.next_batch(1.0, 1_110)
    assert batch is not None and [p.request.priority for p in batch.members] == [0]


def test_quiet_online_traffic_lifts_the_pacing() -> None:
    b = paced(0.1)
    b.add(pending(0, 0, at_ms=1_000))
    for n in range(40):
        b.add(pending(n + 1, -1, at_ms=1_000))
    b.next_batch(1.0, 1_000)
    alone = b.next_batch(1.0, 1_000)
    assert alone is not None
    b.finished(alone, 500.0, 1_500)  # 4.5 s of rest, but online is quiet from 2 s
    assert b.seconds_until_ready(1.0, 1_600) == 0.4
    batch = b.next_batch(1.0, 2_000)
    assert batch is not None and len(batch.members) == 16


def test_background_rows_beside_online_ones_are_paid_for_too() -> None:
    b = paced(0.5)
    for n in range(10):
        b.add(pending(n, -1, at_ms=1_000))
    b.add(pending(20, 0, at_ms=1_000))
    first = b.next_batch(1.0, 1_000)
    assert first is not None and len(first.members) == 3
    b.finished(first, 30.0, 1_030)  # 2 of 3 rows background: 20 ms, then 20 ms of rest
    b.add(pending(21, 0, at_ms=1_040))
    held = b.next_batch(1.0, 1_040)
    assert held is not None and [p.request.priority for p in held.members] == [0]
    b.add(pending(22, 0, at_ms=1_050))
    riding = b.next_batch(1.0, 1_050)
    assert riding is not None and [p.request.priority for p in riding.members] == [0, -1, -1]


def test_background_batches_while_online_is_quiet_leave_no_rest_to_pay_later() -> None:
    b = paced(0.25)
    for n in range(16):
        b.add(pending(n, -1, at_ms=1_000))
    alone = b.next_batch(1.0, 1_000)  # no online request yet: a full batch
    assert alone is not None and len(alone.members) == 16
    b.finished(alone, 60_000.0, 61_000)  # a minute of background alone
    b.add(pending(30, 0, at_ms=61_100))
    b.add(pending(31, -1, at_ms=61_100))
    batch = b.next_batch(1.0, 61_100)
    assert batch is not None and [p.request.priority for p in batch.members] == [0, -1]


def steered(pacing: BackgroundPacing, observed_ms: float, now_ms: int,
            ran: bool = True) -> float:
    """One step: online calls arrived, background rows ran (`ran`), then the steer."""
    pacing.online_arrived(now_ms)
    pacing.finished(1 if ran else 0, 4, 1.0, now_ms)
    pacing.steer(observed_ms, 100.0, now_ms)
    return pacing.share


def test_under_a_latency_target_the_share_grows_while_online_calls_are_well_within_it() -> None:
    pacing = BackgroundPacing(rows=4, share=0.1)
    for step in range(12):  # the online percentile at 30 % of the target, step after step
        steered(pacing, 30.0, 1_000 + step * STEER_MS)
    assert pacing.share == pytest.approx(min(1.0, 0.1 * STEER_GROW ** 12))
    steered(pacing, 30.0, 1_000 + 12 * STEER_MS - 1)  # too soon: no step
    assert pacing.share == pytest.approx(min(1.0, 0.1 * STEER_GROW ** 12))


def test_near_the_target_the_share_is_the_configured_one_again_at_once() -> None:
    pacing = BackgroundPacing(rows=4, share=0.1)
    for step in range(8):
        steered(pacing, 30.0, step * STEER_MS)
    held = steered(pacing, (STEER_ROOM + STEER_BACK) / 2 * 100.0, 8 * STEER_MS)
    assert held == pytest.approx(0.1 * STEER_GROW ** 8)  # between room and back: held
    assert steered(pacing, STEER_BACK * 100.0 + 1, 9 * STEER_MS) == 0.1


def test_the_share_is_earned_while_a_batch_runs_and_lost_when_it_stops() -> None:
    """A share grown while no batch line ran would meet the next batch all at once."""
    pacing = BackgroundPacing(rows=4, share=0.1)
    for step in range(4):
        assert steered(pacing, 10.0, step * STEER_MS, ran=False) == 0.1
    steered(pacing, 10.0, 4 * STEER_MS)
    assert pacing.share > 0.1
    assert steered(pacing, 10.0, 5 * STEER_MS, ran=False) == 0.1


def test_a_grown_share_shortens_the_rest_batch_lines_pay() -> None:
    configured, grown = BackgroundPacing(share=0.1), BackgroundPacing(share=0.1)
    for step in range(4):
        steered(grown, 10.0, step * STEER_MS)
    for pacing in (configured, grown):
        pacing.online_arrived(10_000)
        pacing.resume_ms = 0.0  # no rest owed from the steps above
        pacing.finished(background=4, rows=4, compute_ms=10.0, now_ms=10_000)
    assert grown.held_ms(10_000) < configured.held_ms(10_000) == pytest.approx(90.0)
