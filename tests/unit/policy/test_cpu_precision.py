"""`dtype auto` on a CPU (issue 45): bfloat16 where the CPU has bf16 matrix instructions,
float32 elsewhere; a generative model as measured; an explicit dtype wins. Pure."""

from __future__ import annotations

import pytest

from worker.policy import precision
from worker.policy.precision import choose_precision


@pytest.mark.parametrize("flags", ["AMX tiles", "AVX-512 BF16"])
def test_auto_is_bfloat16_on_a_cpu_with_fast_bf16(flags: str) -> None:
    chosen = choose_precision("auto", "cpu", cpu_bf16=flags)
    assert chosen.dtype == "bfloat16" and flags in chosen.reason


def test_auto_is_float32_on_a_cpu_without_fast_bf16() -> None:
    chosen = choose_precision("auto", "cpu", cpu_bf16=None)
    assert chosen.dtype == "float32" and "without fast bf16" in chosen.reason


def test_auto_for_a_generative_model_follows_the_measurement(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "GENERATIVE_CPU_BF16", False)
    chosen = choose_precision("auto", "cpu", cpu_bf16="AMX tiles", generative=True)
    assert chosen.dtype == "float32" and chosen.reason == precision.GENERATIVE_CPU_WHY
    monkeypatch.setattr(precision, "GENERATIVE_CPU_BF16", True)
    assert choose_precision("auto", "cpu", cpu_bf16="AMX tiles",
                            generative=True).dtype == "bfloat16"


@pytest.mark.parametrize("setting", ["float32", "bfloat16"])
@pytest.mark.parametrize("flags", [None, "AMX tiles"])
def test_an_explicit_dtype_wins(setting: str, flags: str | None) -> None:
    chosen = choose_precision(setting, "cpu", cpu_bf16=flags, generative=True)
    assert chosen.dtype == setting and chosen.reason == "as set"


def test_cuda_ignores_the_cpu_flags() -> None:
    assert choose_precision("auto", "cuda", (7, 5), cpu_bf16="AMX tiles").dtype == "float16"


@pytest.mark.parametrize("flags", [None, "AMX tiles"])
def test_int8_is_taken_only_when_asked_on_a_cpu_for_an_encoder_kind(flags: str | None) -> None:
    chosen = choose_precision("int8", "cpu", cpu_bf16=flags)
    assert chosen.dtype == "int8" and "dynamic int8" in chosen.reason
    assert choose_precision("auto", "cpu", cpu_bf16=flags).dtype != "int8"
    with pytest.raises(precision.UnsupportedDtype, match="runs on a CPU"):
        choose_precision("int8", "cuda", (9, 0))
    with pytest.raises(precision.UnsupportedDtype, match="encoder kinds"):
        choose_precision("int8", "cpu", cpu_bf16=flags, generative=True)
