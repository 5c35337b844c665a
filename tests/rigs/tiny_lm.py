"""A tiny GPT-2-architecture causal LM and a byte-level BPE tokenizer, built offline.

Random weights from a fixed seed with a large `initializer_range`, so greedy choices are
far from ties and batched and single-prompt decoding must agree token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from worker.models.generation_params import SamplingParams

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "redis streams carry requests to workers that batch them",
    "what is the capital of france? paris is the capital of france.",
    "continuous batching lets new requests join between decoding steps",
    "hello world, hello redis, hello batching",
] * 20
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def build_tiny_lm(path: Path, seed: int = 0, initializer_range: float = 0.8,
                  n_positions: int = 128) -> Path:
    """Save the tiny model and its tokenizer under `path` (from_pretrained-able)."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=320, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer,
                                        eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=n_positions, n_embd=64,
                        n_layer=2, n_head=4, initializer_range=initializer_range,
                        bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    model = GPT2LMHeadModel(config)
    model.eval()
    model.save_pretrained(path)
    return path


def engine_text(lm: Any, tokenizer: Any, prompt: str, params: SamplingParams,
                matcher: Any = None) -> str:
    """What the worker's engine generates for one request, uninterrupted, in process
    (`matcher`: its grammar's, for a constrained one)."""
    import torch

    from worker.execution.generation import GenerationEngine
    from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState

    engine = GenerationEngine(lm, tokenizer, torch.device("cpu"), {tokenizer.eos_token_id})
    scheduler = DecodingScheduler(SchedulerLimits())
    ids = list(tokenizer(prompt).input_ids)
    engine.add("x", ids, params, matcher=matcher)
    scheduler.add(SeqState("x", len(ids), params.max_new_tokens))
    while len(scheduler):
        plan = scheduler.schedule()
        scheduler.update(engine.step(plan).finished)
    return str(engine.seqs["x"].text.text)
