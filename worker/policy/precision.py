"""The dtype a model computes in: the `dtype` setting resolved for the device, or refused.

`auto`: bfloat16 on CUDA of compute capability 8.0 and up (Ampere on: tensor cores, and
fp32's range, so no overflow in long sums), float16 on older CUDA, float32 on a CPU (where
half precision is no faster for the small matmuls of a batch, and less exact). float32 on
CUDA lets matmuls run in TF32 on the tensor cores (8.0 and up), as PyTorch's own
`set_float32_matmul_precision("high")` would. On a CPU, `auto` is bfloat16 where the CPU
has bf16 matrix instructions (AMX tiles or AVX-512 BF16, measured 4.35x faster than float32
for MiniLM at min cosine 0.9999, issue 45), float32 elsewhere (bf16 is emulated, and slower).
A generative model keeps float32 on a CPU under `auto` unless its greedy tokens were
measured in bf16 (GENERATIVE_CPU_BF16). `int8`, never chosen by `auto`: dynamic int8 linear
layers on a CPU for the encoder kinds (models/quantize.py); MiniLM's embeddings in int8 have a
min cosine of 0.944 against float32 on 200 sentences, under the 0.999 bound bf16 meets,
and are slower than bf16 (183 against 133 ms at 64 x 48 tokens, 2 threads, AVX-512 BF16).
Pure: the device is described by its type, capability and CPU bf16 support, so this is
tested on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
FLOAT32 = "float32"
FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
INT8 = "int8"  # dynamic int8 linear layers, activations and the rest in float32
DTYPES = (AUTO, FLOAT32, FLOAT16, BFLOAT16, INT8)
BF16_CAPABILITY = (8, 0)  # Ampere: bfloat16 tensor cores (and TF32)
FP16_CAPABILITY = (5, 3)  # half-precision arithmetic
#: SmolLM2-135M, 10 prompts x 16 greedy tokens, bf16 against fp32 on an AMX Xeon: 6 of 10
#: identical (4 differ from step 3 to 11), under the 90 % bound, so a generative model keeps
#: float32 on a CPU under auto
GENERATIVE_CPU_BF16 = False
GENERATIVE_CPU_WHY = "auto: float32 for a generative model on a CPU (bf16 greedy tokens " \
    "matched fp32 on 6/10 prompts, under the 90 % bound)"


class UnsupportedDtype(ValueError):
    """The device cannot compute in the requested dtype; the message is one line for users."""


@dataclass(frozen=True, slots=True)
class Precision:
    dtype: str  # float32, float16, bfloat16 (a torch dtype's name) or int8 (float32 + int8)
    tf32: bool  # float32 matmuls may run in TF32
    reason: str  # why, for the serving log line

    def describe(self) -> str:
        return f"{self.dtype}{' (tf32 matmuls)' if self.tf32 else ''}"


def choose_precision(setting: str, device_type: str,
                     capability: tuple[int, int] | None = None, cpu_bf16: str | None = None,
                     generative: bool = False) -> Precision:
    """The dtype for `setting` on a device of `device_type` (`cuda`: with its compute
    `capability`; `cpu`: `cpu_bf16` names its fast bf16 instructions, None: none); for a
    `generative` model or not; UnsupportedDtype if that device cannot run it."""
    if setting not in DTYPES:
        raise UnsupportedDtype(f"dtype must be one of {', '.join(DTYPES)}; got {setting!r}")
    cuda = device_type == "cuda"
    if cuda and capability is None:
        raise ValueError("a CUDA device's compute capability is needed")
    if setting == INT8:
        return int8(device_type, generative)
    if setting == AUTO:
        if not cuda:
            return cpu_auto(device_type, cpu_bf16, generative)
        assert capability is not None
        if capability >= BF16_CAPABILITY:
            return Precision(BFLOAT16, False, "auto: bfloat16 on CUDA >= 8.0")
        return Precision(FLOAT16, False, "auto: float16 on CUDA < 8.0")
    if cuda:
        assert capability is not None
        _check_cuda(setting, capability)
        if setting == FLOAT32:
            return Precision(FLOAT32, capability >= BF16_CAPABILITY, "as set")
    return Precision(setting, False, "as set")


def _check_cuda(dtype: str, capability: tuple[int, int]) -> None:
    """Refuse a half dtype that a GPU of this compute capability has no arithmetic for."""
    major, minor = capability
    if dtype == BFLOAT16 and capability < BF16_CAPABILITY:
        raise UnsupportedDtype(f"dtype bfloat16 needs a CUDA device of compute capability 8.0 "
                               f"or above; this one is {major}.{minor}: use float16 or auto")
    if dtype == FLOAT16 and capability < FP16_CAPABILITY:
        raise UnsupportedDtype(f"dtype float16 needs a CUDA device of compute capability 5.3 "
                               f"or above; this one is {major}.{minor}: use float32")


def cpu_auto(device_type: str, cpu_bf16: str | None, generative: bool) -> Precision:
    """`auto` off CUDA: bfloat16 where the CPU has bf16 matrix instructions."""
    if device_type != "cpu" or cpu_bf16 is None:
        return Precision(FLOAT32, False, f"auto: float32 on {device_type} without fast bf16")
    if generative and not GENERATIVE_CPU_BF16:
        return Precision(FLOAT32, False, GENERATIVE_CPU_WHY)
    return Precision(BFLOAT16, False, f"auto: bfloat16 on a CPU with {cpu_bf16}")


def int8(device_type: str, generative: bool) -> Precision:
    """`int8`: PyTorch's dynamic int8 linear kernels run on a CPU, for the encoder kinds."""
    if device_type != "cpu":
        raise UnsupportedDtype(f"dtype int8 (dynamic int8 linear layers) runs on a CPU; "
                               f"this device is {device_type}: use auto")
    if generative:
        raise UnsupportedDtype("dtype int8 is for the encoder kinds (minilm, encoder, "
                               "reranker); a generative model takes auto, float32 or bfloat16")
    return Precision(INT8, False, "as set: dynamic int8 linear layers, the rest float32")
