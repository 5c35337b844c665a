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

The model's attention is the engine's own (execution/paged_attention.py, through
transformers' AttentionInterface), its layout set for the forward (`stepping`). A step's
inputs go to the device in one copy (execution/staging.py, step_buffers.py); its tokens are
chosen there (execution/sampling.py, after the grammar masks of execution/grammar_mask.py
and the penalties) and come back in one copy, with their logprobs where asked
(execution/logprobs.py). `step` is `launch` then `finish`; between the two the caller may
launch the next step, whose decoding rows then read their input tokens on the device (steps
overlapped, on a GPU). Preempted and finished sequences give their blocks back; a preempted
one's next prefill recomputes its cache. Torch only: no Redis, no threads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from worker.execution import forks, logprobs
from worker.execution.detokenize import Delta, TextState, decoder_of
from worker.execution.executor import is_out_of_memory
from worker.execution.grammar_mask import GrammarMasks, mask_vocab
from worker.execution.kv_pool import BLOCK_TOKENS, KVPool
from worker.execution.paged_attention import Layout, stepping, use_paged_attention
from worker.execution.sampling import choose_tokens
from worker.execution.staging import (
    EngineSeq,
    Forward,
    TokensInFlight,
    decode_forward,
    packed_forward,
    row_forward,
    upload,
)
from worker.execution.step_buffers import StepBuffers
from worker.execution.step_graphs import StepGraphs
from worker.execution.step_results import Launched, StepOutput, Unrun, emitting_rows
from worker.models.generation_params import SamplingParams
from worker.models.generative import CausalLM, context_of, kv_shape
from worker.policy.decoding import StepPlan, Work
from worker.policy.shape_classes import ShapeClasses, decode_classes, prefill_classes

DEFAULT_KV_TOKENS = 16384  # an engine built without a budget (tests, tools)


class GenerationEngine:
    def __init__(self, lm: Any, tokenizer: Any, device: torch.device,
                 eos_ids: Iterable[int] = (), kv_tokens: int = DEFAULT_KV_TOKENS,
                 max_seqs: int = 64, max_step_tokens: int = 512,
                 gpu_shapes: bool | None = None) -> None:
        """`kv_tokens`: the pool's size, the scheduler's KV budget (plus a block per
        sequence for the partly filled last blocks). `gpu_shapes` (default: on CUDA): decodes
        padded to shape classes of up to `max_seqs` rows, prefills packed into one forward
        padded to a class of up to `max_step_tokens` tokens."""
        self.lm = lm
        self.tokenizer = tokenizer
        self.decode = decoder_of(tokenizer)
        self.texts = logprobs.TokenTexts(tokenizer)  # the logprob records' token texts
        self.shared_tokens = 0  # prompt tokens forks took from another's blocks (forks.py)
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
        self.flight: TokensInFlight | None = None  # the last launch's, until it finishes
        self.masks = GrammarMasks(mask_vocab(lm.config.vocab_size, tokenizer), device, max_seqs)
        use_paged_attention(lm)  # generate() on it still runs transformers' sdpa

    def add(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
            entropy: int = 0, fork_of: str | None = None, matcher: Any = None) -> None:
        """`entropy`: seeds an unseeded draw; `fork_of`: a sequence of the same prompt whose
        blocks it may share (forks.py); `matcher`: its grammar's (grammar_mask.py)."""
        seed = params.seed if params.seed is not None else entropy
        self.seqs[seq_id] = EngineSeq(seq_id, list(prompt_ids), TextState(params, self.eos_ids),
                                      seed, fork_of=fork_of, matcher=matcher)

    def knows(self, tokens: Sequence[int]) -> bool:
        """Whether every token is in the model's vocabulary (a resumed stream's tokens are
        read from a key that producers can write too)."""
        return all(0 <= token < self.lm.config.vocab_size for token in tokens)

    def resume(self, seq_id: str, tokens: Sequence[int], sent_text: str) -> str | None:
        """Continue a sequence after the tokens a previous worker streamed (its next prefill
        covers the prompt and them, its matcher is rebuilt from them); returns the finish
        reason if they had ended it."""
        self.masks.replay(self.seqs[seq_id], tokens)
        return self.seqs[seq_id].text.resume(tokens, sent_text, self.decode)

    def drop(self, seq_id: str) -> EngineSeq | None:
        """Forget a sequence; its text is complete (an unfinished character included)."""
        seq = self.seqs.pop(seq_id, None)
        if self.flight is not None:
            self.flight.rows.pop(seq_id, None)
        if seq is not None:
            self._forget(seq)
            seq.text.flush(self.decode)
        return seq

    def step(self, plan: StepPlan,
             on_prefilled: Callable[[Delta], None] | None = None) -> StepOutput:
        """Run the plan to its tokens (launch, then finish)."""
        return self.finish(self.launch(plan, on_prefilled))

    @torch.inference_mode()
    def launch(self, plan: StepPlan,
               on_prefilled: Callable[[Delta], None] | None = None) -> Launched:
        """Run the plan's forwards and choose their tokens on the device; `finish` brings
        them to the host. A decoding row whose input token is the previous launch's reads it
        on the device (staging.py). `on_prefilled` gets each prefilled sequence's token as
        soon as its own forward is done, before the step's other forwards run."""
        for seq_id in plan.preempted:
            self._forget(self.seqs[seq_id])
        decode = [w for w in plan.decode if w.start > 0]  # a 1-token prompt has no cache
        prefill = forks.shared_prefill(self, plan.prefill + [w for w in plan.decode
                                                             if w.start == 0])
        forwards = self._stage(prefill, decode)
        prefilling = len(forwards) - bool(decode)  # the forwards before the decoding one
        chosen: list[tuple[Forward, torch.Tensor]] = []
        early: list[Delta] = []
        for number, forward in enumerate(forwards):
            try:
                tokens = self._run(forward)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                launched = self._send_back(chosen, early)
                launched.unrun = self._out_of_memory(forwards[number:])
                return launched
            if tokens is not None and on_prefilled is not None and number < prefilling:
                deltas = self._take(forward, *logprobs.host_rows([forward], tokens,
                                                                 self.texts)[0])
                for delta in deltas:
                    on_prefilled(delta)
                early += deltas
            elif tokens is not None:
                chosen.append((forward, tokens))
        return self._send_back(chosen, early)

    def _out_of_memory(self, forwards: Sequence[Forward]) -> Unrun:
        """Forwards that did not run, or not to the end: their sequences' caches (perhaps
        half written) are dropped, to be recomputed."""
        for forward in forwards:
            for seq in forward.seqs:
                self._forget(seq)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed forward's blocks, for smaller steps
        return Unrun(forwards[0].works, [w for forward in forwards[1:] for w in forward.works],
                     forwards[0].batched)

    def _send_back(self, chosen: list[tuple[Forward, torch.Tensor]],
                   early: list[Delta]) -> Launched:
        """The chosen tokens in one tensor, copied to the host in one go (asynchronously on
        CUDA); the next launch's decoding rows read theirs from it on the device."""
        if not chosen:
            self.flight = None
            return Launched([], None, None, None, early)
        tokens = logprobs.sent_back(chosen)  # the tokens first, then the logprobs' tails
        self.flight = TokensInFlight(tokens, emitting_rows([f for f, _ in chosen]))
        host, copied = self.buffers.download(tokens)
        return Launched([f for f, _ in chosen], host, copied, self.flight, early)

    def finish(self, launched: Launched) -> StepOutput:
        """The launched step's tokens on the host, appended to their sequences (one dropped
        or ended since the launch is skipped: its token was a step too late)."""
        output = StepOutput(list(launched.early))
        if launched.copied is not None:
            launched.copied.synchronize()
        rows = logprobs.host_rows(launched.forwards, launched.tokens, self.texts)
        for forward, row in zip(launched.forwards, rows, strict=True):
            output.deltas += self._take(forward, *row)
        if self.flight is launched.flight:
            self.flight = None
        return output

    def _stage(self, prefill: Sequence[Work], decode: Sequence[Work]) -> list[Forward]:
        """Every forward's inputs, built on the host and copied to the device at once: the
        prefill chunks (one forward each, or packed into one, shaped for a GPU), then the
        decoding rows together (padded to a shape class, shaped for a GPU)."""
        def seqs(works: Sequence[Work]) -> list[EngineSeq]:
            return [self.seqs[w.id] for w in works]

        pool, flight = self.pool, self.flight
        if self.gpu_shapes:
            forwards = [packed_forward(pool, self.prefills, self.max_seqs, seqs(prefill),
                                       prefill)] if prefill else []
            forwards += [decode_forward(pool, self.shapes, seqs(decode), decode, flight)
                         ] if decode else []
        else:
            forwards = [row_forward(pool, seqs([work]), [work], flight) for work in prefill]
            forwards += [row_forward(pool, seqs(decode), decode, flight)] if decode else []
        if decode:
            forwards[-1].batched = True
        upload(self.buffers, forwards, flight)
        return forwards

    def _run(self, forward: Forward) -> torch.Tensor | None:
        """The forward, then each of its rows' token chosen on the device (None when no
        row emits one), and their logprobs (logprobs.py) after any grammar's mask and before
        the penalties."""
        logits = self._forward(forward)
        if forward.draws is None:
            return None
        if masked := self.masks.fill(forward.seqs, forward.works):  # while the device computes
            logits = self.masks.apply(logits, masked)
        raw = logits
        packed = forward.device[1] if len(forward.device) > 1 else None
        if forward.penalties is not None:
            layout = forward.layout
            newest = forward.device[0].view(layout.rows, layout.queries)[:len(forward.seqs), -1]
            logits = forward.penalties.apply(logits, newest)
        tokens = choose_tokens(logits, forward.draws, packed)
        return logprobs.with_logprobs(forward, raw, tokens)

    def _take(self, forward: Forward, tokens: list[int],
              records: list[logprobs.Record | None]) -> list[Delta]:
        """Each emitting row's token appended to its sequence, unless that was dropped or
        ended since the forward was launched."""
        return [self._append(seq, token, record) for seq, work, token, record
                in zip(forward.seqs, forward.works, tokens, records, strict=True)
                if work.emits and not seq.ended and self.seqs.get(seq.id) is seq]

    def _forward(self, forward: Forward) -> torch.Tensor:
        """The logits of each real row's last token [rows, vocab]: a captured graph's
        replay where one holds the step's shape, else the model's forward."""
        layout = forward.layout
        ids = forward.device[0].view(layout.rows, layout.queries)
        logits = self.graphs.replay(ids, layout) if self.graphs is not None else None
        if logits is None:
            logits = self.logits(ids, layout)
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
        """CUDA graphs of the decode step for every shape class and of the packed prefill
        for every (queries, keys) class (step_graphs.py); None where not possible."""
        self.graphs = StepGraphs.capture(self)
        return self.graphs

    def _append(self, seq: EngineSeq, token: int,
                 record: logprobs.Record | None = None) -> Delta:
        self.masks.advance(seq, token)
        delta = seq.text.append(seq.id, token, self.decode)
        logprobs.attach(seq.logprobs, delta, record, self.eos_ids)
        if delta.finish_reason:
            seq.ended = True
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
