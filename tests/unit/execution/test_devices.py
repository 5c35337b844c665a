"""Streams, events and staging buffers: their logic on CPU; their real effect on CUDA only."""

from __future__ import annotations

import pytest
import torch

from tests.rigs.plugin_models import MatmulModel
from worker.execution.devices import Lanes, Marker, PinnedStaging
from worker.execution.executor import Executor, resolve_device
from worker.execution.memory import CudaMemory
from worker.models import create_model
from worker.models.base import Prepared

CPU = resolve_device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_staging_buffers_are_reused_per_key_in_two_turns() -> None:
    staging = PinnedStaging(pin=False)
    a = staging.hold("k", torch.arange(6).view(2, 3))
    b = staging.hold("k", torch.arange(6).view(2, 3) + 10)
    staging.release(Marker(None))
    assert a.tolist() == [[0, 1, 2], [3, 4, 5]] and b[0, 0] == 10  # two slots: no overwrite
    c = staging.hold("k", torch.ones(1, 2, dtype=torch.long))  # smaller: back in slot one
    assert c.data_ptr() == a.data_ptr() and c.shape == (1, 2)
    assert staging.allocations == 2
    staging.hold("k", torch.ones(4, 4, dtype=torch.long))  # larger than slot two: it grows
    staging.hold("other", torch.ones(1))
    assert staging.allocations == 4


def test_batches_one_after_another_reuse_one_buffer_per_key() -> None:
    """What the CUDA test below checks on the device: a batch staged after the last one's
    copy finished takes that slot again. Taking the two slots strictly in turn made the
    second batch allocate each key's second buffer: 4 allocations for 2 keys (issue 31)."""
    staging = PinnedStaging(pin=False)
    for _ in range(3):
        staging.hold((0, 0), torch.ones(2, 16, dtype=torch.long))  # input_ids
        staging.hold((0, 1), torch.ones(2, 16, dtype=torch.long))  # attention_mask
        staging.release(Marker(None))  # copied, and done (as after finish() on CUDA)
    assert staging.allocations == 2


def test_on_cpu_lanes_are_no_ops_with_host_timestamps() -> None:
    lanes = Lanes(CPU)
    assert lanes.copy_stream is None and lanes.compute_stream is None
    with lanes.copying():
        start = lanes.mark()
    with lanes.computing():
        end = lanes.mark()
    start.make_wait(lanes.compute_stream)
    end.synchronize()
    assert end.done() and start.ms_until(end) >= 0


def test_executor_steps_run_on_cpu_and_report_a_timeline() -> None:
    model = create_model("echo", {})
    model.load(CPU)
    executor = Executor(model, CPU)
    items = [Prepared(3, "abc"), Prepared(1, "d")]
    staged = executor.stage(items, bucket=0)
    launched = executor.launch(staged)
    assert executor.finish(launched) == ["abc", "d"]
    timeline = launched.timeline_ms()
    assert 0 <= timeline["copy_end"] <= timeline["compute_start"] <= timeline["compute_end"]
    assert executor.run(items) == ["abc", "d"]


@needs_cuda
def test_cuda_memory_counts_a_ballast_and_releases_the_cache() -> None:
    device = torch.device("cuda")
    probe = CudaMemory(device)
    probe.before_batch()
    before = probe.read()
    ballast = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    after = probe.read()
    assert after.used - before.used >= 1 << 30 and after.allocated >= 1 << 30
    del ballast
    probe.release_cache()
    assert probe.read().cached < 1 << 30


@needs_cuda
def test_cuda_batches_are_copied_from_reused_pinned_buffers() -> None:
    device = torch.device("cuda")
    model = create_model("minilm", {})
    model.load(device)
    executor = Executor(model, device, timing=True)
    items = [model.sample(16), model.sample(12)]
    first = executor.run(items, bucket=0)
    allocations = executor.staging.allocations
    assert allocations == 2  # one buffer per tensor of the batch: input_ids, attention_mask
    second = executor.run(items, bucket=0)
    # run() waited for the first batch, whose compute waited for its copy: its slots are free
    # and taken again (strict turns allocated each key's second slot here: 4, not 2)
    assert executor.staging.allocations == allocations
    assert torch.allclose(torch.tensor(first[0]["embedding"]),
                          torch.tensor(second[0]["embedding"]), atol=1e-5)
    slot = executor.staging._slots[(0, 0)][0]
    assert slot.buffer is not None and slot.buffer.is_pinned()


@needs_cuda
def test_cuda_copy_of_the_next_batch_overlaps_the_current_compute() -> None:
    device = torch.device("cuda")
    model = MatmulModel(dim=4096, rounds=50)
    model.load(device)
    executor = Executor(model, device, timing=True)
    big = [Prepared(1, None)] * 64  # 4096 x 4096 floats: 64 MiB to copy
    executor.run(big, bucket=4)  # warm up
    current = executor.launch(executor.stage(big, bucket=4))
    upcoming = executor.stage(big, bucket=4)  # while `current` computes
    executor.finish(current)
    following = executor.launch(upcoming)
    executor.finish(following)
    origin = current.staged.copy_started
    copy_end = origin.ms_until(upcoming.copied)
    assert copy_end < origin.ms_until(current.done)  # copied before the current batch ended


@needs_cuda
def test_cuda_instances_run_on_their_own_streams_with_the_same_results() -> None:
    device = torch.device("cuda")
    model = create_model("minilm", {})
    model.load(device)
    first = Executor(model, device)
    second = first.another()
    assert second.model is model and second.lanes.compute_stream != first.lanes.compute_stream
    items = [model.sample(16), model.sample(12)]
    one, two = first.run(items, bucket=0), second.run(items, bucket=0)
    assert torch.allclose(torch.tensor(one[0]["embedding"]), torch.tensor(two[0]["embedding"]),
                          atol=1e-5)


class PendingCopy(Marker):
    """A copy still in flight until `finish()`: what a CUDA event reports before the copy ends."""

    def __init__(self) -> None:
        super().__init__(None)
        self.finished = False
        self.waited = 0

    def done(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.waited += 1
        self.finished = True


def test_a_free_slot_is_reused_before_a_second_buffer_is_made() -> None:
    """Batch after batch of one shape, each copy finished before the next: one buffer per
    tensor, not two (the CUDA check failed with "allocations 4, expected 2")."""
    staging = PinnedStaging(pin=False)
    first = staging.hold((0, 0), torch.arange(6).view(2, 3))
    staging.release(Marker(None))  # its copy is done
    for _ in range(3):
        again = staging.hold((0, 0), torch.arange(6).view(2, 3))
        staging.release(Marker(None))
        assert again.data_ptr() == first.data_ptr()
    assert staging.allocations == 1


def test_a_slot_whose_copy_is_in_flight_is_not_refilled() -> None:
    staging = PinnedStaging(pin=False)
    first = staging.hold("k", torch.zeros(4))
    in_flight = PendingCopy()
    staging.release(in_flight)
    second = staging.hold("k", torch.ones(4))  # the other slot: the first is still read
    staging.release(PendingCopy())
    assert second.data_ptr() != first.data_ptr() and first.tolist() == [0.0] * 4
    assert staging.allocations == 2 and in_flight.waited == 0
    third = staging.hold("k", torch.full((4,), 2.0))  # both in flight: waits for the first
    assert third.data_ptr() == first.data_ptr() and in_flight.waited == 1
    assert second.tolist() == [1.0] * 4
