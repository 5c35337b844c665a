"""The dtype a model computes in: the `dtype` setting resolved for the device, or refused.

`auto`: bfloat16 on CUDA of compute capability 8.0 and up (Ampere on: tensor cores, and
fp32's range, so no overflow in long sums), float16 on older CUDA, float32 on a CPU (where
half precision is no faster for the small matmuls of a batch, and less exact). float32 on
CUDA lets matmuls run in TF32 on the tensor cores (8.0 and up), as PyTorch's own
`set_float32_matmul_precision("high")` would. Pure: the device is described by its type and
capability, so this is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
FLOAT32 = "float32"
FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
DTYPES = (AUTO, FLOAT32, FLOAT16, BFLOAT16)
BF16_CAPABILITY = (8, 0)  # Ampere: bfloat16 tensor cores (and TF32)
FP16_CAPABILITY = (5, 3)  # half-precision arithmetic


class UnsupportedDtype(ValueError):
    """The device cannot compute in the requested dtype; the message is one line for users."""


@dataclass(frozen=True, slots=True)
class Precision:
    dtype: str  # float32, float16 or bfloat16 (a torch dtype's name)
    tf32: bool  # float32 matmuls may run in TF32
    reason: str  # why, for the serving log line

    def describe(self) -> str:
        return f"{self.dtype}{' (tf32 matmuls)' if self.tf32 else ''}"


def choose_precision(setting: str, device_type: str,
                     capability: tuple[int, int] | None = None) -> Precision:
    """The dtype for `setting` on a device of `device_type` (`cuda`: with its compute
    `capability`); UnsupportedDtype if that device cannot run it."""
    if setting not in DTYPES:
        raise UnsupportedDtype(f"dtype must be one of {', '.join(DTYPES)}; got {setting!r}")
    cuda = device_type == "cuda"
    if cuda and capability is None:
        raise ValueError("a CUDA device's compute capability is needed")
    if setting == AUTO:
        if not cuda:
            return Precision(FLOAT32, False, f"auto: float32 on {device_type}")
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
