"""The batched decoding engine: runs the scheduler's StepPlan on a Hugging Face causal LM.

KV caches live in one paged pool (execution/kv_pool.py): a sequence owns a block table, and
a forward writes only its new tokens' keys and values. A step runs its prefill chunks, then
every decoding sequence together (one new token per row at its own `position_ids`), in
layouts (execution/step_layouts.py) shaped for the device:

- on a CPU, each prefill chunk alone and each decoding row attending alone over exactly
  its tokens: no padded work at all;
- on a GPU, where a launch costs more than a padded row, the prefill chunks packed into one
  forward padded to a (queries, keys) class and the decoding rows padded to a (rows,
  context) class, each with one gather and one attention call per layer; a class with a
  captured CUDA graph (execution/step_graphs.py) replays as one launch.

The model's attention is the engine's own (execution/paged_attention.py, registered through
transformers' AttentionInterface): the forward's layout is set for its duration
(`stepping`), and the forward keeps no cache of its own (`use_cache=False`).

A step's inputs for all its forwards (token ids, positions, KV slots, the sampler's
per-row inputs) go to the device in one copy through preallocated buffers
(execution/step_buffers.py); each forward's tokens are chosen on the device
(execution/sampling.py) and come back in one copy.

Preempted and finished sequences give their blocks back; a preempted one's next prefill
recomputes its cache from its tokens. Torch only: no Redis, no threads (the generate loop,
pipeline/generate.py, calls it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.execution.detokenize import Delta, TextState, decoder_of
from worker.execution.kv_pool import BLOCK_TOKENS, KVPool
from worker.execution.paged_attention import Layout, stepping, use_paged_attention
from worker.execution.sampling import RowDraws, choose_tokens
from worker.execution.step_buffers import StepBuffers
from worker.execution.step_graphs import StepGraphs
from worker.execution.step_layouts import DecodeLayout, PackedLayout, StepLayout
from worker.models.generation_params import SamplingParams
from worker.models.generative import CausalLM, context_of, kv_shape
from worker.policy.decoding import StepPlan, Work
from worker.policy.shape_classes import ShapeClasses, decode_classes, prefill_classes

DEFAULT_KV_TOKENS = 16384  # an engine built without a budget (tests, tools)


@dataclass(slots=True)
class EngineSeq:
    id: str
    prompt_ids: list[int]
    text: TextState
    seed: int  # its draws' (execution/sampling.py): the request's seed, or its entropy
    blocks: list[int] = field(default_factory=list)  # its block table in the pool
    slots: list[int] = field(default_factory=list)  # its tokens' slots, as far as reserved
    cached: int = 0  # tokens whose keys and values are in its blocks

    def tokens(self, start: int, end: int) -> list[int]:
        prompt = len(self.prompt_ids)
        if start >= prompt:  # a decode: no copy of the whole sequence
            return self.text.generated[start - prompt:end - prompt]
        return (self.prompt_ids + self.text.generated)[start:end]


@dataclass(slots=True)
class StepOutput:
    deltas: list[Delta] = field(default_factory=list)  # one per sequence that sampled

    @property
    def finished(self) -> list[str]:
        return [d.id for d in self.deltas if d.finish_reason]


@dataclass(slots=True)
class Forward:
    """One forward of a step, staged: its rows, their layout, ids and draws."""

    seqs: list[EngineSeq]
    works: list[Work]
    layout: Layout
    ids: list[int]  # rows x queries, padded; a device view once uploaded
    draws: RowDraws | None  # None when no row emits a token
    batched: bool  # the step's decode rows together (else one sequence alone)
    device: list[torch.Tensor] = field(default_factory=list)  # ids (and draws) on device


class GenerationEngine:
    def __init__(self, lm: Any, tokenizer: Any, device: torch.device,
                 eos_ids: Iterable[int] = (), kv_tokens: int = DEFAULT_KV_TOKENS,
                 max_seqs: int = 64, max_step_tokens: int = 512,
                 gpu_shapes: bool | None = None) -> None:
        """`kv_tokens`: the pool's size, the scheduler's KV budget (plus a block per
        sequence for the partly filled last blocks). `gpu_shapes`: steps shaped for a GPU,
        decodes padded to shape classes of up to `max_seqs` rows and prefills packed into
        one forward padded to a class of up to `max_step_tokens` tokens (default: on CUDA
        only)."""
        self.lm = lm
        self.tokenizer = tokenizer
        self.decode = decoder_of(tokenizer)
        self.device = device
        self.eos_ids = frozenset(eos_ids)
        self.seqs: dict[str, EngineSeq] = {}
        self.pool = KVPool(*kv_shape(lm.config), tokens=kv_tokens, dtype=lm.dtype,
                           device=device)
        self.buffers = StepBuffers(device)
        self.gpu_shapes = device.type == "cuda" if gpu_shapes is None else gpu_shapes
        self.max_seqs = max_seqs
        self.shapes: ShapeClasses = decode_classes(max_seqs, min(kv_tokens, context_of(lm)))
        self.prefills: ShapeClasses = prefill_classes(max_step_tokens, kv_tokens)
        self.graphs: StepGraphs | None = None  # capture_graphs() fills it, on CUDA
        use_paged_attention(lm)  # generate() on it still runs transformers' sdpa

    def add(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
            entropy: int = 0) -> None:
        """`entropy`: seeds the draws of an unseeded sampling request."""
        seed = params.seed if params.seed is not None else entropy
        self.seqs[seq_id] = EngineSeq(seq_id, list(prompt_ids),
                                      TextState(params, self.eos_ids), seed)

    def resume(self, seq_id: str, tokens: Sequence[int], sent_text: str) -> str | None:
        """Continue a sequence after the tokens a previous worker streamed (its next prefill
        covers the prompt and them); returns the finish reason if they had ended it."""
        return self.seqs[seq_id].text.resume(tokens, sent_text, self.decode)

    def drop(self, seq_id: str) -> EngineSeq | None:
        """Forget a sequence; its text is complete (an unfinished character included)."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self._forget(seq)
            seq.text.flush(self.decode)
        return seq

    @torch.inference_mode()
    def step(self, plan: StepPlan,
             on_prefilled: Callable[[Delta], None] | None = None) -> StepOutput:
        """Run the plan. `on_prefilled` is called with each prefilled sequence's new token
        as soon as its own forward is done, before the step's other forwards: its reply
        stream can carry a first token while the other prefills run."""
        for seq_id in plan.preempted:
            self._forget(self.seqs[seq_id])
        decode = [w for w in plan.decode if w.start > 0]  # a 1-token prompt has no cache
        prefill = plan.prefill + [w for w in plan.decode if w.start == 0]
        forwards = self._stage(prefill, decode)
        prefilling = len(forwards) - bool(decode)  # the forwards before the decoding one
        output = StepOutput()
        for number, forward in enumerate(forwards):
            deltas = self._run(forward)
            if on_prefilled is not None and number < prefilling:
                for delta in deltas:
                    on_prefilled(delta)
            output.deltas += deltas
        return output

    def _stage(self, prefill: Sequence[Work], decode: Sequence[Work]) -> list[Forward]:
        """Every forward's inputs, built on the host and copied to the device at once: the
        prefill chunks (one forward each, or packed into one, shaped for a GPU), then the
        decoding rows together (padded to a shape class, shaped for a GPU)."""
        if self.gpu_shapes:
            forwards = [self._plan_packed(prefill)] if prefill else []
            forwards += [self._plan_decode(decode)] if decode else []
        else:
            forwards = [self._plan([work]) for work in prefill]
            forwards += [self._plan(decode)] if decode else []
        if decode:
            forwards[-1].batched = True
        parts: list[Sequence[int] | torch.Tensor] = []
        for forward in forwards:
            parts += [forward.ids, *forward.layout.host]
            if forward.draws is not None and forward.draws.samples:
                parts.append(forward.draws.packed())
        views = iter(self.buffers.upload(parts))
        for forward in forwards:
            forward.device = [next(views)]
            forward.layout.bind(*[next(views) for _ in forward.layout.host])
            if forward.draws is not None and forward.draws.samples:
                forward.device.append(next(views))
        return forwards

    def _reserve(self, works: Sequence[Work]) -> list[EngineSeq]:
        """The rows' sequences, their blocks reserved and slots worked out up to the work."""
        seqs = [self.seqs[w.id] for w in works]
        for seq, work in zip(seqs, works, strict=True):
            assert seq.cached == work.start, (seq.id, seq.cached, work.start)
            self.pool.reserve(seq.blocks, work.end)
            if work.end > len(seq.slots):  # only the new tokens' slots are worked out
                seq.slots += self.pool.slot_list(seq.blocks, work.end, len(seq.slots))
        return seqs

    def _plan_decode(self, works: Sequence[Work]) -> Forward:
        """The decoding rows padded to their shape class (or, past every class, to their
        own count and longest context): one token each, real rows first."""
        seqs = self._reserve(works)
        longest = max(w.end for w in works)
        shape = self.shapes.fit(len(works), longest) or (len(works), longest)
        layout = DecodeLayout(self.pool, [s.blocks for s in seqs], [w.end for w in works],
                              shape, bind=False)
        ids = [seq.tokens(w.start, w.end)[0] for seq, w in zip(seqs, works, strict=True)]
        return Forward(seqs, list(works), layout, ids + [0] * (layout.rows - len(ids)),
                       self._draws(seqs, works), batched=True)

    def _plan_packed(self, works: Sequence[Work]) -> Forward:
        """The step's prefill chunks one after another in one row, padded at the end to
        their (queries, keys) class (or, past every class, not at all)."""
        seqs = self._reserve(works)
        queries, keys = sum(w.tokens for w in works), sum(w.end for w in works)
        # + 1 key: padding queries must have a padding key to read (PackedLayout)
        shape = self.prefills.fit(queries, keys + 1) if len(works) <= self.max_seqs else None
        layout = PackedLayout(self.pool, [s.slots for s in seqs], [w.start for w in works],
                              [w.end for w in works], bind=False, shape=shape,
                              rows=self.max_seqs)
        ids: list[int] = []
        for seq, work in zip(seqs, works, strict=True):
            ids += seq.tokens(work.start, work.end)
        return Forward(seqs, list(works), layout, ids + [0] * (layout.queries - queries),
                       self._draws(seqs, works), batched=False)

    def _draws(self, seqs: Sequence[EngineSeq], works: Sequence[Work]) -> RowDraws | None:
        if not any(w.emits for w in works):
            return None
        return RowDraws.of([s.text.params for s in seqs], [s.seed for s in seqs],
                           [len(s.text.generated) for s in seqs])

    def _plan(self, works: Sequence[Work]) -> Forward:
        """One forward's rows: blocks reserved, slots laid out, ids left-padded."""
        seqs = self._reserve(works)
        layout = StepLayout(self.pool, [s.blocks for s in seqs], [w.start for w in works],
                            [w.end for w in works], bind=False, slots=[s.slots for s in seqs])
        ids: list[int] = []
        for seq, work in zip(seqs, works, strict=True):
            ids += [0] * (layout.queries - work.tokens) + seq.tokens(work.start, work.end)
        return Forward(seqs, list(works), layout, ids, self._draws(seqs, works),
                       batched=False)

    def _run(self, forward: Forward) -> list[Delta]:
        """The forward, then its rows' tokens chosen on the device, copied back at once."""
        logits = self._forward(forward)
        if forward.draws is None:
            return []
        packed = forward.device[1] if len(forward.device) > 1 else None
        tokens: list[int] = choose_tokens(logits, forward.draws, packed).tolist()
        return [self._append(seq, token) for seq, work, token
                in zip(forward.seqs, forward.works, tokens, strict=True) if work.emits]

    def _forward(self, forward: Forward) -> torch.Tensor:
        """The logits of each real row's last token [rows, vocab]: a captured graph's
        replay where one holds the step's shape, else the model's forward."""
        layout = forward.layout
        ids = forward.device[0].view(layout.rows, layout.queries)
        graph = self.graphs.get(layout) if self.graphs is not None else None
        logits = graph.replay(ids, layout) if graph is not None else self.logits(ids, layout)
        for seq, work in zip(forward.seqs, forward.works, strict=True):
            seq.cached = work.end
        return logits[:len(forward.seqs)]

    def logits(self, ids: torch.Tensor, layout: Layout) -> torch.Tensor:
        """The model's forward over the layout: each row's last logits [rows, vocab]."""
        with stepping(layout):
            out = self.lm(input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool),
                          use_cache=False, position_ids=layout.positions,
                          logits_to_keep=layout.keep)
        if layout.attended != len(self.pool.keys):  # a layer bypassed the pool: wrong tokens
            raise RuntimeError(f"{layout.attended} of {len(self.pool.keys)} layers ran the "
                               "engine's paged attention")
        return layout.last_logits(out.logits)

    def capture_graphs(self) -> StepGraphs | None:
        """Capture a CUDA graph of the decode step for every shape class and of the packed
        prefill for every (queries, keys) class (step_graphs.py); None, and eager steps,
        where that is not possible (it says why)."""
        self.graphs = StepGraphs.capture(self)
        return self.graphs

    def _append(self, seq: EngineSeq, token: int) -> Delta:
        delta = seq.text.append(seq.id, token, self.decode)
        if delta.finish_reason:
            self._forget(seq)  # its blocks are free for the next step
        return delta

    def _forget(self, seq: EngineSeq) -> None:
        self.pool.release(seq.blocks)
        seq.slots.clear()
        seq.cached = 0


def engine_for(model: CausalLM, cuda_graphs: bool = True) -> GenerationEngine:
    """A loaded causal LM's engine, its KV pool sized to the scheduler's budget (and one
    more block per sequence for the partly filled last ones), its decode steps and packed
    prefills captured as CUDA graphs on a GPU unless `cuda_graphs` is false."""
    limits = model.scheduler_limits()
    engine = GenerationEngine(model.lm, model.tokenizer, model.device, model.eos_ids,
                              kv_tokens=limits.kv_tokens + limits.max_seqs * BLOCK_TOKENS,
                              max_seqs=limits.max_seqs,
                              max_step_tokens=limits.max_step_tokens)
    if cuda_graphs and model.device.type == "cuda":
        engine.capture_graphs()
    return engine
