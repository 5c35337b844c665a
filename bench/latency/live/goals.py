"""The goals of `python -m bench.latency.live` on real processes, and the configurations
that run them: each goal's load (phases of Poisson arrivals, seeded, the same for every
configuration), its requests (payload lengths) and its device (the echo cost model).

- G1 step load 25 % -> 90 % -> 25 % of C; G3 overload at 150 % of C, shedding on.
- G2 light load: 25 % of C; redbatch's p50 against `static wait 0 batch 32`'s.
- G4 drift: 50 % of C (the simulator's load); after the first phase the echo model costs
  x1.5 (`drift_after_requests`: the warm-up plus the arrivals before the step, so the step
  falls on a window's start); the drifted phase lasts 3 phases (with 20 s phases 6
  windows, as in the simulator), so the windows after the 3 allowed for recovery count.
- G5 mixed lengths: the simulator's two-peaked mix (70 % of 8-16 bytes, 30 % of 96-128)
  on a per-token cost (10 ms + 0.02 ms per padded byte), at 75 % of that cost model's C.
  Echo's default boundaries put the two peaks in buckets 0 and 1.

`--model minilm` runs the same goals on the real MiniLM encoder instead of the echo cost
model (MINILM): every request is a text of the two-peaked token-length mix, T defaults to
250 ms and C is MiniLM's own. For G4 the worker serves
`bench.latency.live.drifting:DriftingMiniLM`, the same encoder with echo's drift options
(each batch then takes x1.5 its forward's time).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from bench.latency.sim.goals import Scenario, two_peaks
from bench.latency.sim.simulate import Phase, ServiceCost, poisson_arrivals

COST: dict[str, Any] = {"model": "echo", "model_options": {"delay_ms": 10, "per_item_ms": 1},
        "instances": 2, "max_batch_size": 32, "read_count": 256, "max_inflight": 4096}
STATICS = [(0.0, 32), (5.0, 32), (20.0, 32), (0.0, 8), (5.0, 8)]
PAYLOADS = [msgpack.packb({"n": i}) for i in range(64)]
G2_BASELINE = "static wait 0 batch 32"
DRIFT_FACTOR = 1.5
G5_OPTIONS = {"delay_ms": 10, "per_item_ms": 0, "per_token_ms": 0.02}
# C of G5's cost model: the simulator's sweep on it (`capacity(g5_scenario())`, 1307.6/s)
# scaled by measured / simulated C of the echo cost model (C here / 1493.1), since a sweep
# on real processes would cost minutes of the benchmark's time; `--g5-capacity` overrides.
G5_SIM_CAPACITY, ECHO_SIM_CAPACITY = 1307.6, 1493.1
ECHO_BOUNDARIES = (64, 256, 1024, 4096)  # EchoModel.default_bucket_boundaries
# MiniLM as the worker lays it out by default: one single-threaded instance per core
MINILM_COST: dict[str, Any] = {"model": "minilm", "instances": "auto", "max_batch_size": 32,
                               "read_count": 256, "max_inflight": 4096, "torch_threads": 1}
PEAKS = (16, 128)  # the report's groups for MiniLM: the two peaks of two_peaks


def text_payload(tokens: int) -> bytes:
    """A MiniLM request of exactly `tokens` tokens ([CLS], the words, [SEP])."""
    payload: bytes = msgpack.packb({"text": " ".join(["word"] * (tokens - 2))})
    return payload


@dataclass(frozen=True)
class Device:
    """What serves the requests: the worker's settings, how a request of a given length is
    written, the groups of lengths the report shows, and whether every goal mixes lengths
    (MiniLM) or only G5 (echo, whose other goals send small fixed payloads)."""

    name: str
    base: dict[str, Any]
    payload: Callable[[int], bytes]
    boundaries: Sequence[int]
    target_ms: float
    mixed: bool
    saturation_repeats: int  # how many times the saturation run sends its 64 requests
    drift_model: str  # the model that takes the drift options (G4), served as `name`

    def payloads(self, lengths: Sequence[int] | None) -> list[bytes]:
        if lengths is None:
            return PAYLOADS
        return [self.payload(n) for n in lengths]

    def sample_lengths(self, seed: int = 0) -> list[int] | None:
        """The lengths of the saturation run's 64 distinct requests (None: echo's own)."""
        rng = random.Random(seed)
        return [two_peaks(rng) for _ in range(len(PAYLOADS))] if self.mixed else None




def g5_scenario(target_ms: float = 100.0) -> Scenario:
    """G5's device and length mix in the simulator, to find its C there."""
    return Scenario("echo, 10 ms + 0.02 ms per padded byte, two-peaked lengths",
                    ServiceCost(10.0, G5_OPTIONS["per_token_ms"], 0.05), two_peaks,
                    list(ECHO_BOUNDARIES[:2]), target_ms=target_ms, instances=2)


def configs(target_ms: float, shed: bool,
            base: dict[str, Any] = COST) -> dict[str, dict[str, Any]]:
    redbatch = {**base, "latency_target_ms": target_ms, "shed_over_target": shed}
    return {"redbatch": redbatch,
            **{f"static wait {w:g} batch {n}": {**base, "max_wait_ms": w, "max_batch_size": n}
               for w, n in STATICS},
            **{name: {**base, **extra} for name, extra in baselines(target_ms).items()}}


def baselines(target_ms: float) -> dict[str, dict[str, Any]]:
    """The adaptive baselines as worker settings, started as the simulator starts them (AIMD
    and step dispatch at once, the dynamic timeout waits 10 ms); none of them sheds.
    `bentoml_cork` refuses at dispatch (worker/policy/cork.py)."""
    return {"aimd": {"batch_controller": "aimd", "controller_target_ms": target_ms,
                     "max_wait_ms": 0.0},
            "step": {"batch_controller": "step", "controller_target_ms": target_ms,
                     "max_wait_ms": 0.0},
            "dynamic timeout": {"batch_controller": "dynamic_timeout"},
            "bentoml_cork": {"batch_controller": "cork", "controller_target_ms": target_ms,
                             "max_wait_ms": 0.0}}


def offsets(phases: Sequence[Phase], seed: int) -> list[float]:
    return [a.at_ms / 1000 for a in poisson_arrivals(phases, lambda rng: 1, seed)]


def sized_payload(length: int) -> bytes:
    """A msgpack payload of exactly `length` bytes (bin 8: a 2-byte header), for echo's
    length, which is the payload's encoded size."""
    payload: bytes = msgpack.packb(b"x" * (length - 2))
    assert len(payload) == length, (length, len(payload))
    return payload


ECHO_DEVICE = Device("echo", COST, sized_payload, ECHO_BOUNDARIES, 100.0, False, 100, "echo")
MINILM_DEVICE = Device("minilm", MINILM_COST, text_payload, PEAKS, 250.0, True, 10,
                       "bench.latency.live.drifting:DriftingMiniLM")
DEVICES = {d.name: d for d in (ECHO_DEVICE, MINILM_DEVICE)}


@dataclass(frozen=True)
class Goal:
    """One goal: its load, its requests' lengths (None: echo's small fixed payloads), the
    echo options it adds, and when the device drifts (seconds into the arrivals)."""

    name: str
    phases: list[Phase]
    shed: bool = False
    lengths: Callable[[random.Random], int] | None = None
    model_options: dict[str, Any] = field(default_factory=dict)
    drift_at_s: float | None = None

    def arrivals(self, seed: int) -> tuple[list[float], list[int] | None]:
        """The sending offsets (s) and, with a length mix, each request's length."""
        if self.lengths is None:
            return offsets(self.phases, seed), None
        arrivals = poisson_arrivals(self.phases, self.lengths, seed)
        return [a.at_ms / 1000 for a in arrivals], [a.length for a in arrivals]

    def settings(self, base: dict[str, Any], warmed: int, sent_at: Sequence[float],
                 device: Device = ECHO_DEVICE) -> dict[str, Any]:
        """`base` with this goal's echo options; the drift after `warmed` warm-up requests
        and the arrivals before `drift_at_s`, on the device's model that drifts."""
        options = {**base.get("model_options", {}), **self.model_options}
        if self.drift_at_s is None:
            return {**base, "model_options": options} if options else dict(base)
        before = sum(1 for at in sent_at if at < self.drift_at_s)
        options |= {"drift_after_requests": warmed + before, "drift_factor": DRIFT_FACTOR}
        return {**base, "model": device.drift_model, "model_name": device.name,
                "model_options": options}

    def described(self, base: dict[str, Any] = COST) -> dict[str, Any]:
        """What the report needs to apply the goal's rules."""
        return {"phases": [[p.seconds, round(p.rate_per_s, 1)] for p in self.phases],
                "model_options": {**base.get("model_options", {}), **self.model_options},
                "drift_at_s": self.drift_at_s,
                "drift_factor": DRIFT_FACTOR if self.drift_at_s is not None else None}


def goals(c: float, phase_s: float, wanted: Sequence[str], c5: float | None = None,
          device: Device = ECHO_DEVICE) -> list[Goal]:
    """The goals named in `wanted` (G1..G5), in that order of number. `c5`: G5's C (echo's
    G5 has a cost model of its own). On MiniLM every goal sends the two-peaked mix, and G5
    is that mix at 75 % of C."""
    if device.mixed:
        return mixed_goals(c, phase_s, wanted)
    c5 = c * G5_SIM_CAPACITY / ECHO_SIM_CAPACITY if c5 is None else c5
    every = [*load_goals(c, phase_s, None), drift_goal(c, phase_s, None),
             Goal("G5 mixed lengths", [Phase(phase_s, 0.75 * c5)], lengths=two_peaks,
                  model_options=G5_OPTIONS)]
    return chosen(every, wanted)


def drift_goal(c: float, phase_s: float,
               lengths: Callable[[random.Random], int] | None) -> Goal:
    """G4 at 50 % of C; the drifted phase lasts 3 phases (20 s phases: 6 windows after the
    step, as in the simulator)."""
    return Goal("G4 drift", [Phase(phase_s, 0.5 * c), Phase(3 * phase_s, 0.5 * c)],
                lengths=lengths, drift_at_s=phase_s)


def load_goals(c: float, phase_s: float,
               lengths: Callable[[random.Random], int] | None) -> list[Goal]:
    """G1-G3: the loads, with every request drawn from `lengths` (None: fixed payloads)."""
    return [Goal("G1 step load", [Phase(phase_s, 0.25 * c), Phase(phase_s, 0.9 * c),
                                  Phase(phase_s, 0.25 * c)], lengths=lengths),
            Goal("G2 light load", [Phase(phase_s, 0.25 * c)], lengths=lengths),
            Goal("G3 overload", [Phase(phase_s, 1.5 * c)], shed=True, lengths=lengths)]


def mixed_goals(c: float, phase_s: float, wanted: Sequence[str]) -> list[Goal]:
    every = [*load_goals(c, phase_s, two_peaks), drift_goal(c, phase_s, two_peaks),
             Goal("G5 mixed lengths", [Phase(phase_s, 0.75 * c)], lengths=two_peaks)]
    return chosen(every, wanted)


def chosen(every: Sequence[Goal], wanted: Sequence[str]) -> list[Goal]:
    unknown = set(wanted) - {g.name.split()[0] for g in every}
    if unknown:
        raise ValueError(f"no goal {sorted(unknown)}; there are G1-G5")
    return [g for g in every if g.name.split()[0] in wanted]
