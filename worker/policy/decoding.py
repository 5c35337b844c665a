"""Iteration-level scheduling for generative models (continuous batching).

A plain state machine in the style of vLLM v1's `schedule() -> SchedulerOutput` and TGI's
queue `State`: every step, the running sequences decode one token each and waiting ones are
admitted to prefill (a long prompt in chunks), within a token budget per step
(`max_step_tokens`) and a cap on running sequences (`max_seqs`). Memory is the KV cache:
`bytes_per_token` (2 x layers x kv_heads x head_dim x dtype bytes) against `kv_budget_bytes`.
When a step's tokens do not fit, the most recently admitted running sequence is preempted by
recompute: its cache is dropped and it waits again, in its old place, to be re-prefilled with
its tokens so far. No request is lost.

Order: higher priority first, then oldest. A waiting sequence that has waited `max_wait_steps`
steps is aged: it goes before every unaged one whatever their priority, and while the first
in line cannot be admitted, nothing behind it is (so memory frees up for it as running
sequences finish); background ones (batch jobs' lines) give their seats to online ones.
A waiting sequence is therefore admitted within `max_wait_steps` plus the steps the
sequences running then need to finish (at most their `max_new_tokens` plus one; with
`prefill_first`, (1 + `prefill_streak`) times that, as up to `prefill_streak` steps in a
row may go to admissions alone).

Token accounting: a sequence's tokens are its prompt and what it generated. `computed` of
them are in its cache. A step feeds it tokens [computed, computed + n); when that reaches its
last token, the step samples a new one (`emits`). A decoding sequence has n = 1. No I/O, no
clock, no threads: the generate loop (pipeline/generate.py) drives it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from worker.policy.step_caps import StepCaps

BLOCK_TOKENS = 16  # the KV pool's block (execution/kv_pool.py): a fork shares whole blocks


@dataclass(slots=True, eq=False)  # compared by identity: `seq in running` each step, per row
class SeqState:
    """One generation request as the scheduler sees it."""

    id: str
    prompt_len: int
    max_new_tokens: int
    priority: int = 0
    arrival: int = 0  # set by add(): the order of arrival
    generated: int = 0
    computed: int = 0  # tokens in the KV cache
    waited: int = 0  # steps spent waiting since it last arrived or was preempted
    preemptions: int = 0
    after: str | None = None  # a fork: admitted once this sequence has its prompt cached

    @property
    def total(self) -> int:
        return self.prompt_len + self.generated

    @property
    def done(self) -> bool:
        return self.generated >= self.max_new_tokens


@dataclass(frozen=True, slots=True)
class Work:
    """The tokens [start, end) of one sequence fed in this step."""

    id: str
    start: int
    end: int
    emits: bool  # the step samples this sequence's next token

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class StepPlan:
    decode: list[Work] = field(default_factory=list)  # running sequences, one token each
    prefill: list[Work] = field(default_factory=list)  # prompt (or recompute) chunks
    preempted: list[str] = field(default_factory=list)  # caches to drop before the step
    admitted: list[str] = field(default_factory=list)  # first chunk in this step

    @property
    def work(self) -> list[Work]:
        return self.decode + self.prefill

    @property
    def tokens(self) -> int:
        return sum(w.tokens for w in self.work)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_step_tokens: int = 512
    max_seqs: int = 16
    bytes_per_token: int = 1
    kv_budget_bytes: int = 1 << 30
    max_wait_steps: int = 32
    prefill_first: bool = False  # admissions get a step of their own (see schedule())
    prefill_streak: int = 1  # the most such steps in a row before running ones decode

    def __post_init__(self) -> None:
        for name in ("max_step_tokens", "max_seqs", "bytes_per_token", "kv_budget_bytes",
                     "max_wait_steps", "prefill_streak"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def kv_tokens(self) -> int:
        return self.kv_budget_bytes // self.bytes_per_token


class DecodingScheduler:
    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        self.waiting: list[SeqState] = []
        self.running: list[SeqState] = []  # in order of admission
        self._arrivals = 0
        self._plan: StepPlan | None = None
        self._gone: list[SeqState] = []  # those the last update() let go
        self._streak = 0  # prefill-only steps in a row, up to the last one
        # what a step may hold now: the limits, or less after a step ran out of memory
        self.caps = StepCaps(limits.max_step_tokens, limits.max_seqs)

    # --- queue --------------------------------------------------------------------------------

    def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether one sequence alone can ever finish within the KV budget (its last token
        is sampled, never cached)."""
        return prompt_len + max_new_tokens - 1 <= self.limits.kv_tokens

    def add(self, seq: SeqState) -> None:
        if not self.fits(seq.prompt_len, seq.max_new_tokens):
            raise ValueError(f"{seq.id}: {seq.prompt_len} + {seq.max_new_tokens} tokens do "
                             f"not fit the KV budget of {self.limits.kv_tokens} tokens")
        seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self.waiting.append(seq)

    def remove(self, seq_id: str) -> SeqState | None:
        """Take a sequence out wherever it is (cancelled); its cache is the caller's to drop."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.id == seq_id:
                    queue.remove(seq)
                    return seq
        return None

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def used_tokens(self) -> int:
        return sum(s.computed for s in self.running)

    def _order(self, seq: SeqState) -> tuple[bool, int, int]:
        aged = seq.waited >= self.limits.max_wait_steps
        return (not aged, 0 if aged else -seq.priority, seq.arrival)

    # --- one step -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The work of the next step. Call update() with its outcome before the next one.

        With `prefill_first`, a step that can admit waiting requests admits only them: a
        new request's first token then waits for its own prefill, not for every running
        sequence's decode as well (time to first token), and decoding loses one step. At most
        `prefill_streak` such steps in a row: an arrival during another's prefill then gets
        its own too, and decoding still runs at least once every `prefill_streak` + 1 steps."""
        plan = StepPlan()
        while len(self.running) > self.caps.seqs:  # the cap was cut: the newest wait again
            self._preempt(plan, self.running[-1])
        self._yield_to_online(plan)
        budget = self.caps.tokens
        free = self.limits.kv_tokens - self.used_tokens
        prefill_only = False
        stalled = self._streak >= self.limits.prefill_streak
        if self.limits.prefill_first and not stalled and self.running:
            self._admit_waiting(plan, budget, free)
            prefill_only = bool(plan)
        if not plan:
            budget, free = self._schedule_running(plan, budget, free)
            self._admit_waiting(plan, budget, free)
        self._streak = self._streak + 1 if prefill_only else 0
        for seq in self.waiting:
            seq.waited += 1
        self._plan = plan
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int, free: int) -> tuple[int, int]:
        """Running sequences first, oldest admitted first; the newest are preempted while
        the step's tokens do not fit the cache."""
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            n = min(seq.total - seq.computed, budget)
            while n > free and seq in self.running:
                free += self._preempt(plan, self.running[-1])
            if seq not in self.running:
                break  # it was the newest itself
            work = Work(seq.id, seq.computed, seq.computed + n, seq.computed + n == seq.total)
            (plan.decode if seq.total - seq.computed == 1 else plan.prefill).append(work)
            budget, free, index = budget - n, free - n, index + 1
        return budget, free

    def _yield_to_online(self, plan: StepPlan) -> None:
        """Online requests waiting for a seat take those of the newest background sequences
        (priority < 0) never preempted before: each is recomputed at most once for it."""
        short = sum(s.priority >= 0 for s in self.waiting) - (self.caps.seqs - len(self.running))
        for seq in reversed(list(self.running)):
            if short > 0 and seq.priority < 0 and not seq.preemptions:
                self._preempt(plan, seq)
                short -= 1

    def _preempt(self, plan: StepPlan, seq: SeqState) -> int:
        """Drop its cache; it waits again in its old place. Returns the tokens freed."""
        self.running.remove(seq)
        freed, seq.computed, seq.waited = seq.computed, 0, 0
        seq.preemptions += 1
        plan.preempted.append(seq.id)
        plan.decode = [w for w in plan.decode if w.id != seq.id]
        plan.prefill = [w for w in plan.prefill if w.id != seq.id]
        self.waiting.append(seq)
        return freed

    def _admit_waiting(self, plan: StepPlan, budget: int, free: int) -> None:
        """Waiting sequences in order, while a first chunk fits the budget, `max_seqs` and
        the cache with a token to spare per running sequence (so the admitted one is not
        preempted at the next step); the first that does not fit stops the admission."""
        self.waiting.sort(key=self._order)
        while self.waiting and budget > 0 and len(self.running) < self.caps.seqs:
            seq = next((s for s in self.waiting if not self._held(s)), None)
            if seq is None or seq.id in plan.preempted:
                break  # not re-admitted in the step that preempted it
            shared = self._shared(seq)  # a fork's: in its cache, not computed
            n = min(seq.total - shared, budget)
            if shared + n + len(self.running) > free:
                break  # room is left for each running sequence's next token
            self.waiting.remove(seq)
            seq.waited = 0
            self.running.append(seq)
            plan.prefill.append(Work(seq.id, 0, shared + n, shared + n == seq.total))
            plan.admitted.append(seq.id)
            budget, free = budget - n, free - shared - n

    def _held(self, fork: SeqState) -> bool:
        """A fork waits while the sequence it shares a prompt with has not cached it (it
        then takes that prompt's blocks instead of computing them: execution/forks.py)."""
        if fork.after is None:
            return False
        if any(s.id == fork.after for s in self.waiting):
            return True
        return any(s.id == fork.after and s.computed < s.prompt_len for s in self.running)

    def _shared(self, fork: SeqState) -> int:
        """The prompt tokens a fork takes from its source's blocks (whole blocks before its
        last token; execution/forks.py), which its first step need not compute."""
        source = next((s for s in self.running if s.id == fork.after), None) \
            if fork.after is not None else None
        if source is None or source.computed < source.prompt_len:
            return 0
        return (min(fork.prompt_len, source.prompt_len) - 1) // BLOCK_TOKENS * BLOCK_TOKENS

    def update(self, finished: Iterable[str] = ()) -> list[SeqState]:
        """Apply the last plan: tokens cached, tokens sampled; `finished` (EOS, a stop
        string, cancelled) and those at max_new_tokens leave at once. Returns those."""
        plan, self._plan = self._plan, None
        if plan is None:
            raise RuntimeError("update() without a schedule()")
        by_id = {s.id: s for s in self.running}
        for work in plan.work:
            seq = by_id.get(work.id)
            if seq is not None:
                seq.computed = work.end
                seq.generated += work.emits
        ended = set(finished)
        gone = [s for s in self.running if s.id in ended or s.done]
        self.running = [s for s in self.running if s not in gone]
        self._gone = gone
        self.caps.on_step()
        return gone

    def recompute(self, works: Sequence[Work]) -> None:
        """The last plan's `works` did not run (the step ran out of memory): each of their
        sequences drops its cache and waits again, in its old place, its token uncounted
        (one that update() let go at its max_new_tokens comes back)."""
        known = {s.id: s for s in [*self.running, *self._gone]}
        for work in works:
            seq = known.get(work.id)
            if seq is None:
                continue  # removed since (cancelled)
            seq.generated -= work.emits
            if seq in self.running:
                self.running.remove(seq)
            seq.computed, seq.waited = 0, 0
            seq.preemptions += 1
            if seq not in self.waiting:
                self.waiting.append(seq)
