"""Running batches: the three executor steps on CPU, memory sampling, and OOM splitting."""

from __future__ import annotations

import psutil
import pytest
import torch

from producer.request_entry import Request
from tests.rigs.plugin_models import FixedMemory, PressureModel
from worker.execution.executor import Executor, is_out_of_memory, resolve_device
from worker.execution.guarded_runner import BatchRunner, TooLarge
from worker.execution.memory import HostMemory, cgroup_memory_limit
from worker.models.base import Prepared
from worker.policy.batching import Batch, BatchLimits, Pending
from worker.policy.governor import Governor, GovernorPolicy, MemoryReading

CPU = resolve_device("cpu")


CALM = MemoryReading(10, 100)


def make_runner(max_padded_tokens: int | None, reading: MemoryReading = CALM) -> BatchRunner:
    model = PressureModel(max_padded_tokens)
    model.load(CPU)
    governor = Governor(BatchLimits(32, 8192, 0.0), buckets=2, policy=GovernorPolicy())
    return BatchRunner(Executor(model, CPU), governor, FixedMemory(reading), "pressure")


def items(*lengths: int) -> list[Prepared]:
    return [Prepared(length, {"i": i}) for i, length in enumerate(lengths)]


def test_an_oom_batch_is_split_until_every_piece_fits() -> None:
    runner = make_runner(max_padded_tokens=40)
    batch = items(*[10] * 16)  # 160 padded tokens
    assert runner.run(0, batch) == [{"i": i} for i in range(16)]
    assert runner.oom_events == 3  # 160 tokens fails, then both halves of 80: 1 + 2
    assert runner.splits == 3
    assert max(runner.executor.model.batch_tokens) <= 40  # type: ignore[attr-defined]
    assert runner.governor.caps[0].tokens <= 40
    assert runner.governor.caps[1] == runner.governor.base[1]  # other buckets untouched
    assert runner.governor.ceilings[0].smallest_failed == 80
    assert isinstance(runner.memory, FixedMemory) and runner.memory.released == 3


def test_only_the_input_too_large_alone_gets_too_large() -> None:
    runner = make_runner(max_padded_tokens=40)
    results = runner.run(0, items(10, 50, 10, 10))
    assert results[0] == {"i": 0} and results[2:] == [{"i": 2}, {"i": 3}]
    assert isinstance(results[1], TooLarge) and "50" in results[1].message


def test_pipelined_steps_recover_from_oom_at_finish() -> None:
    runner = make_runner(max_padded_tokens=30)
    request = Request(id="x", payload=b"", content_type="json", reply_to="r")
    batch = Batch(0, [Pending("1-0", request, item, 0.0) for item in items(10, 10, 10, 10)])
    job = runner.stage(batch)
    runner.launch(job)
    assert job.error is not None and is_out_of_memory(job.error)
    assert job.error.__traceback__ is None  # the failed batch's frames are not kept alive
    assert runner.finish(job) == [{"i": i} for i in range(4)]
    assert job.compute_s > 0 and job.started_ms > 0


def test_a_model_error_that_is_not_oom_is_raised_not_split() -> None:
    runner = make_runner(max_padded_tokens=None)
    runner.executor.model.forward = lambda batch: 1 / 0  # type: ignore[method-assign]
    with pytest.raises(ZeroDivisionError):
        runner.run(0, items(10, 10))
    assert runner.oom_events == 0


def test_a_high_reading_after_a_batch_cuts_the_caps() -> None:
    runner = make_runner(max_padded_tokens=None, reading=MemoryReading(95, 100))
    runner.run(1, items(10, 10))
    assert runner.governor.caps[0].requests == 16


@pytest.mark.parametrize("exc, expected", [
    (torch.OutOfMemoryError("CUDA out of memory"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                  "memory: you tried to allocate 1099511627776 bytes"), True),
    (MemoryError(), True),
    (RuntimeError("shape mismatch"), False),
])
def test_out_of_memory_is_recognised(exc: Exception, expected: bool) -> None:
    assert is_out_of_memory(exc) is expected


def test_a_real_cpu_allocation_failure_is_recognised() -> None:
    with pytest.raises(RuntimeError) as info:
        torch.empty(1 << 62, dtype=torch.uint8)
    assert is_out_of_memory(info.value)


def test_host_memory_reads_rss_against_the_limit(tmp_path) -> None:
    reading = HostMemory(limit_bytes=1 << 40).read()
    assert 0 < reading.used < 1 << 40 and reading.limit == 1 << 40
    rss = psutil.Process().memory_info().rss  # what the kept-open /proc/self/statm says too
    assert abs(HostMemory().rss() - rss) < 32 << 20
    assert HostMemory().limit > 0  # the cgroup limit, or physical memory
    (tmp_path / "v2").write_text("max\n")
    (tmp_path / "v1").write_text("536870912\n")
    assert cgroup_memory_limit((tmp_path / "v2",)) is None
    assert cgroup_memory_limit((tmp_path / "none", tmp_path / "v1")) == 512 << 20


def test_when_idle_a_large_unused_cache_is_released() -> None:
    runner = make_runner(None, reading=MemoryReading(50, 100, reserved=40, allocated=35))
    memory = runner.memory
    assert isinstance(memory, FixedMemory)
    runner.release_if_fragmented()
    assert memory.released == 0
    memory.reading = MemoryReading(50, 100, reserved=40, allocated=10)
    runner.release_if_fragmented()
    assert memory.released == 1
