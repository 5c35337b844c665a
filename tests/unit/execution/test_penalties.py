"""Penalties, logit_bias and min_tokens (worker/execution/penalties.py) against values
worked out by hand, and their payload checks (worker/models/penalty_params.py)."""

from __future__ import annotations

import pytest
import torch

from worker.execution.penalties import RowPenalties
from worker.models.base import InvalidInput
from worker.models.generation_params import SamplingParams, sampling_params
from worker.models.penalty_params import logit_bias

CPU = torch.device("cpu")


def apply(params: list[SamplingParams], output: list[list[int]], logits: list[list[float]],
          prompts: list[list[int]] | None = None, eos: tuple[int, ...] = ()) -> torch.Tensor:
    rows = RowPenalties.of(params, output, prompts or [[] for _ in params],
                           [False] * len(params), eos)
    assert rows is not None
    return rows.apply(torch.tensor(logits), None)


def test_frequency_and_presence_penalties_by_hand() -> None:
    # output [1, 1, 2]: counts 0, 2, 1, 0; logit -= 0.5 * count + 1.0 * (count > 0)
    params = SamplingParams(8, frequency_penalty=0.5, presence_penalty=1.0)
    out = apply([params], [[1, 1, 2]], [[1.0, 2.0, 3.0, 4.0]])
    assert out.tolist() == [[1.0, 2.0 - 1.0 - 1.0, 3.0 - 0.5 - 1.0, 4.0]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    # token 0 in the prompt, token 2 in the output: 2.0 / 2 = 1.0, -3.0 * 2 = -6.0
    params = SamplingParams(8, repetition_penalty=2.0)
    out = apply([params], [[2]], [[2.0, 5.0, -3.0, 1.0]], prompts=[[0]])
    assert out.tolist() == [[1.0, 5.0, -6.0, 1.0]]


def test_an_unpenalised_row_beside_penalised_ones_is_unchanged_to_the_bit() -> None:
    logits = torch.randn(3, 50)
    penalised = SamplingParams(8, 0.7, frequency_penalty=1.5, repetition_penalty=1.3,
                               logit_bias=((3, 100.0),), min_tokens=4)
    rows = RowPenalties.of([penalised, SamplingParams(8), penalised],
                           [[1, 2, 2], [1, 2, 2], []], [[5], [5], [5]], [False] * 3, [7])
    assert rows is not None
    out = rows.apply(logits, None)
    assert torch.equal(out[1], logits[1])
    assert out[0, 3] == logits[0, 3] + 100 and out[0, 7] == float("-inf")
    assert RowPenalties.of([SamplingParams(8)], [[1]], [[2]], [False]) is None


def test_logit_bias_adds_per_row_and_min_tokens_blocks_eos_until_reached() -> None:
    biased = SamplingParams(8, logit_bias=((0, -100.0), (2, 5.0)), min_tokens=2)
    out = apply([biased, SamplingParams(8, min_tokens=2)], [[1], [1, 1]],
                [[1.0, 1.0, 1.0, 1.0]] * 2, eos=(3,))
    # row 0 has drawn 1 token of 2: its EOS (3) is blocked; row 1 has drawn 2: free
    assert out.tolist() == [[-99.0, 1.0, 6.0, float("-inf")], [1.0, 1.0, 1.0, 1.0]]


def test_a_token_in_flight_counts_from_the_device() -> None:
    params = SamplingParams(8, presence_penalty=1.0)
    rows = RowPenalties.of([params], [[0]], [[]], [True])
    assert rows is not None and rows.drawn == [2]
    out = rows.apply(torch.zeros(1, 4), torch.tensor([2]))
    assert out.tolist() == [[-1.0, 0.0, -1.0, 0.0]]


def test_logit_bias_is_clamped_and_checked() -> None:
    assert logit_bias({"5": 250, "2": -1e9, "7": 1}) == ((2, -100.0), (5, 100.0), (7, 1.0))
    for bad in ({"x": 1}, {"-1": 1}, {"1.5": 1}, {"3": "a"}, {"3": float("nan")}, [1],
                {str(i): 1 for i in range(301)}):
        with pytest.raises(InvalidInput) as raised:
            logit_bias(bad)
        assert raised.value.details["field"] == "logit_bias"
    with pytest.raises(InvalidInput):
        logit_bias({"50": 1}, vocab=50)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("repetition_penalty", "1"), ("min_tokens", -1), ("min_tokens", 1.5),
    ("logit_bias", {"a": 1})])
def test_payload_fields_out_of_range_name_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidInput) as raised:
        sampling_params({field: value}, 3, 100, 16, 64, vocab=50)
    assert raised.value.details["field"] == field


def test_payload_fields_parsed_and_min_tokens_cut_to_max_tokens() -> None:
    params = sampling_params({"presence_penalty": 1, "logit_bias": {"4": 2}, "min_tokens": 99,
                              "max_new_tokens": 10}, 3, 100, 16, 64, vocab=50)
    assert params.presence_penalty == 1.0 and params.logit_bias == ((4, 2.0),)
    assert params.min_tokens == 10 and params.penalised
    assert not sampling_params({}, 3, 100, 16, 64).penalised
