"""The pure parts of logprobs (execution/logprobs.py, models/logprob_params.py): the payload
field, the tail's layout and its decoding on the host, a delta's records (an EOS token has
none), and a byte-level token's own bytes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from worker.execution.detokenize import Delta
from worker.execution.logprobs import attach, host_rows, sent_back, tail, with_logprobs
from worker.models.base import InvalidInput
from worker.models.generation_params import SamplingParams, fork_of, sampling_params


@pytest.mark.parametrize("value", [21, -1, True, 1.5, "2"])
def test_the_payload_field_is_an_integer_from_0_to_20(value: object) -> None:
    assert sampling_params({"logprobs": 20}, 3, 100, 16, 64).logprobs == 20
    assert sampling_params({"logprobs": None}, 3, 100, 16, 64).logprobs is None
    with pytest.raises(InvalidInput) as raised:
        sampling_params({"logprobs": value}, 3, 100, 16, 64)
    assert raised.value.details["field"] == "logprobs"


def test_fork_of_is_a_hint_a_bad_one_is_ignored() -> None:
    assert fork_of({"fork_of": "1-0"}) == "1-0"
    assert fork_of({"fork_of": 5}) is None and fork_of({"fork_of": "x" * 201}) is None


class Texts:
    """Token i is the letter chr(97 + i)."""

    def record(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        return {"id": token, "token": chr(97 + token), "logprob": logprob,
                "top_logprobs": [{"token": chr(97 + i), "logprob": v} for i, v in top]}


def forward(*asked: int | None) -> Any:
    seqs = [SimpleNamespace(text=SimpleNamespace(params=SamplingParams(4, logprobs=a)))
            for a in asked]
    return SimpleNamespace(seqs=seqs, logprobs=None)


def test_tails_ride_after_every_token_and_decode_to_log_softmax() -> None:
    torch.manual_seed(0)
    logits = [torch.randn(2, 6), torch.randn(1, 6)]
    forwards = [forward(2, None), forward(None)]
    tokens = [torch.tensor([3, 1]), torch.tensor([5])]
    results = [(f, with_logprobs(f, x, t)) for f, x, t in zip(forwards, logits, tokens,
                                                               strict=True)]
    assert forwards[0].logprobs == 2 and forwards[1].logprobs is None
    host = sent_back(results)
    assert host[:3].tolist() == [3, 1, 5] and host.numel() == 3 + 2 * (1 + 2 * 2)
    rows = host_rows(forwards, host, Texts())  # type: ignore[arg-type]
    expected = torch.log_softmax(logits[0], dim=-1)
    (chosen, records), (last, none) = rows
    assert chosen == [3, 1] and last == [5] and none == [None]
    assert records[1] is None and records[0] is not None
    assert records[0]["logprob"] == pytest.approx(expected[0, 3].item())
    best = torch.topk(expected[0], 2)
    assert [t["token"] for t in records[0]["top_logprobs"]] == \
        [chr(97 + i) for i in best.indices.tolist()]
    assert tail(logits[1], tokens[1], 0).numel() == 1  # logprobs 0: the chosen one's only


def test_a_delta_gets_the_records_of_its_tokens_and_eos_has_none() -> None:
    kept: list[dict[str, Any]] = []
    held = Delta("s", "", [])  # text held back (a stop string may start)
    attach(kept, held, {"id": 4, "token": "e"}, frozenset({9}))
    assert held.logprobs is None and len(kept) == 1
    out = Delta("s", "ef", [4, 5])
    attach(kept, out, {"id": 5, "token": "f"}, frozenset({9}))
    assert out.logprobs == [{"token": "e"}, {"token": "f"}]
    end = Delta("s", "", [9], "stop")
    attach(kept, end, {"id": 9, "token": ""}, frozenset({9}))
    assert end.logprobs == [] and len(kept) == 2
