"""bf16 under the Triton interpreter, with ``ops.interpreter_compat`` installed, matches the GPU.

Small kernels run under ``TRITON_INTERPRET=1`` on CPU bf16 tensors and are compared with torch on
the same inputs. torch computes a bf16 elementwise op as fp32 math rounded once to nearest even, as
the GPU does, so elementwise results must match bit for bit (NaN compared as NaN, any payload).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITONCHECK_BACKEND", "auto") != "interpreter":
    pytest.skip(
        "ops.interpreter_compat patches the Triton interpreter only; this run uses the CUDA backend",
        allow_module_level=True,
    )
os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit below

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle, interpreter_builder

from ops.interpreter_compat import install, installed

install()

N = 32
NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def bf16(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)


def with_random_tail(values: list[float], seed: int, scale: float = 4.0) -> torch.Tensor:
    """``values`` followed by random bf16 values (both signs), N elements in all."""
    gen = torch.Generator().manual_seed(seed)
    tail = torch.randn(N - len(values), generator=gen) * scale
    return torch.cat([bf16(values), tail.to(torch.bfloat16)])


def fp32_from_bits(bits: list[int]) -> torch.Tensor:
    signed = [b - (1 << 32) if b >= 1 << 31 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise equality, except that any NaN matches any NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), f"NaN mismatch:\n{actual}\n{expected}"
    int_dtype = torch.int16 if actual.dtype in (torch.bfloat16, torch.float16) else torch.int32
    same = actual.view(int_dtype) == expected.view(int_dtype)
    bad = (~same & ~nan).nonzero().flatten().tolist()
    assert not bad, f"mismatch at {bad[:8]}: got {actual[bad[:8]]}, expected {expected[bad[:8]]}"


def bf16_handle(x: torch.Tensor) -> TensorHandle:
    return TensorHandle(x.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)


def bf16_from_handle(handle: TensorHandle) -> torch.Tensor:
    assert handle.dtype == tl.bfloat16 and handle.data.dtype == np.uint16
    return torch.from_numpy(handle.data.view(np.int16).copy()).view(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# kernels (grid = (1,); every row of ``out`` holds one op's result)
# ---------------------------------------------------------------------------------------------


@triton.jit
def binary_kernel(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    y = tl.load(y_ptr + offs)
    tl.store(out_ptr + 0 * N + offs, x + y)
    tl.store(out_ptr + 1 * N + offs, x - y)
    tl.store(out_ptr + 2 * N + offs, x * y)
    tl.store(out_ptr + 3 * N + offs, x / y)  # Triton promotes bf16 / and % to fp32; the store rounds
    tl.store(out_ptr + 4 * N + offs, x % y)
    tl.store(out_ptr + 5 * N + offs, -x)  # Triton lowers -x to 0.0 - x


@triton.jit
def fma_kernel(x_ptr, y_ptr, z_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    y = tl.load(y_ptr + offs)
    z = tl.load(z_ptr + offs)
    tl.store(out_ptr + offs, tl.fma(x, y, z))


@triton.jit
def unary_kernel(x_ptr, out_ptr, N: tl.constexpr):
    # tl.exp & co. accept only fp32/fp64 (on the GPU too), so bf16 kernels upcast first.
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    xf = x.to(tl.float32)
    tl.store(out_ptr + 0 * N + offs, tl.exp(xf))  # implicit fp32 -> bf16 cast in the store
    tl.store(out_ptr + 1 * N + offs, tl.log(xf))
    tl.store(out_ptr + 2 * N + offs, tl.sqrt(xf))
    tl.store(out_ptr + 3 * N + offs, tl.rsqrt(xf))
    tl.store(out_ptr + 4 * N + offs, tl.abs(x))  # tl.abs takes bf16 directly


@triton.jit
def minmax_kernel(x_ptr, y_ptr, lo_ptr, hi_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    y = tl.load(y_ptr + offs)
    lo = tl.load(lo_ptr + offs)
    hi = tl.load(hi_ptr + offs)
    tl.store(out_ptr + 0 * N + offs, tl.maximum(x, y))
    tl.store(out_ptr + 1 * N + offs, tl.minimum(x, y))
    tl.store(out_ptr + 2 * N + offs, tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL))
    tl.store(out_ptr + 3 * N + offs, tl.minimum(x, y, propagate_nan=tl.PropagateNan.ALL))
    tl.store(out_ptr + 4 * N + offs, tl.clamp(x, lo, hi))
    tl.store(out_ptr + 5 * N + offs, tl.clamp(x, lo, hi, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def compare_where_kernel(x_ptr, y_ptr, cmp_ptr, where_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    y = tl.load(y_ptr + offs)
    tl.store(cmp_ptr + 0 * N + offs, (x < y).to(tl.int8))
    tl.store(cmp_ptr + 1 * N + offs, (x <= y).to(tl.int8))
    tl.store(cmp_ptr + 2 * N + offs, (x > y).to(tl.int8))
    tl.store(cmp_ptr + 3 * N + offs, (x >= y).to(tl.int8))
    tl.store(cmp_ptr + 4 * N + offs, (x == y).to(tl.int8))
    tl.store(cmp_ptr + 5 * N + offs, (x != y).to(tl.int8))
    tl.store(where_ptr + 0 * N + offs, tl.where(x > y, x, y))
    tl.store(where_ptr + 1 * N + offs, tl.where(x < 0, 0.1, x))  # 0.1: fp32 constant cast to bf16


@triton.jit
def dot_kernel(a_ptr, b_ptr, acc_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rm = tl.arange(0, M)
    rk = tl.arange(0, K)
    rn = tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    acc = tl.load(acc_ptr + rm[:, None] * N + rn[None, :])
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b, acc))


@triton.jit
def downcast_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + 0 * N + offs, x)  # implicit cast in the store
    tl.store(out_ptr + 1 * N + offs, x.to(tl.bfloat16))
    tl.store(out_ptr + 2 * N + offs, x.to(tl.bfloat16, fp_downcast_rounding="rtz"))


@triton.jit
def full_kernel(out_ptr, VALUE: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.full([N], VALUE, tl.bfloat16))


@triton.jit
def cast_kernel(x_ptr, i_ptr, to_int_ptr, from_int_ptr, to_fp16_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(to_int_ptr + offs, x.to(tl.int32))
    tl.store(from_int_ptr + offs, tl.load(i_ptr + offs).to(tl.bfloat16))
    tl.store(to_fp16_ptr + offs, x.to(tl.float16))


@triton.jit
def add_combine(a, b):
    return a + b


@triton.jit
def reduce_kernel(
    x_ptr, sum_ptr, max_ptr, min_ptr, argmax_ptr, argmin_ptr, cumsum_ptr, R: tl.constexpr, N: tl.constexpr
):
    rows = tl.arange(0, R)
    cols = tl.arange(0, N)
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :])
    tl.store(sum_ptr + rows, tl.sum(x, axis=1))
    tl.store(max_ptr + rows, tl.max(x, axis=1))
    tl.store(min_ptr + rows, tl.min(x, axis=1))
    tl.store(argmax_ptr + rows, tl.argmax(x, axis=1))
    tl.store(argmin_ptr + rows, tl.argmin(x, axis=1))
    tl.store(cumsum_ptr + rows[:, None] * N + cols[None, :], tl.cumsum(x, axis=1))


@triton.jit
def generic_reduce_kernel(x_ptr, add_ptr, max_ptr, R: tl.constexpr, N: tl.constexpr):
    rows = tl.arange(0, R)
    cols = tl.arange(0, N)
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :])
    tl.store(add_ptr + rows, tl.reduce(x, 1, add_combine))  # slow path: bf16 add per step
    tl.store(max_ptr + rows, tl.reduce(x, 1, tl.standard._elementwise_max))  # fast path, no upcast


@triton.jit
def scan_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + 0 * N + offs, tl.cumprod(x, axis=0))
    tl.store(out_ptr + 1 * N + offs, tl.cumsum(x, axis=0, reverse=True))
    tl.store(out_ptr + 2 * N + offs, tl.associative_scan(x, 0, add_combine))  # slow path


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


def test_install_is_idempotent() -> None:
    assert installed()
    patched = InterpreterBuilder.binary_op
    install()
    install()
    assert InterpreterBuilder.binary_op is patched


def test_install_refuses_numpy_2_4(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(np, "__version__", "2.4.0")
    with pytest.raises(RuntimeError, match=r"numpy<2\.4"):
        install()


@pytest.mark.parametrize("version", ["3.5.1", "3.9.0"])
def test_install_refuses_another_triton_release(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(triton, "__version__", version)
    with pytest.raises(RuntimeError, match=rf"triton {version} is installed.*triton==3\.6"):
        install()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy warns on x / 0 in the stock fp32 path
def test_add_sub_mul_div_mod_neg() -> None:
    x = with_random_tail([2.5, 0.0, -0.0, INF, -INF, NAN, 1.0, 3e38, 1e-38, -7.0, 1.0], seed=0)
    y = with_random_tail([2.0, -0.0, -0.0, INF, 1.0, 1.0, NAN, 3e38, 1e-38, 0.0, 3.0], seed=1)
    out = torch.empty(6, N, dtype=torch.bfloat16)
    binary_kernel[(1,)](x, y, out, N=N)
    assert out[0, 0].item() == 4.5  # 2.5 + 2.0; the stock interpreter gives about -2.9e-39
    for row, expected in enumerate([x + y, x - y, x * y, x / y, torch.fmod(x, y), torch.zeros_like(x) - x]):
        assert_same_bits(out[row], expected)


def test_fma_rounds_once() -> None:
    # 1.5 * (1 + 2**-7) lies exactly halfway between two bf16 values; a tiny z decides the rounding,
    # which computing in fp32 and then rounding to bf16 gets wrong.
    tie = [1.5, 1 + 2**-7]
    cases = [(*tie, 0.0, 1.515625), (*tie, -(2**-60), 1.5078125), (*tie, -(2**-30), 1.5078125)]
    xs, ys, zs, expected_head = (list(column) for column in zip(*cases, strict=True))
    gen = torch.Generator().manual_seed(2)

    def operand() -> torch.Tensor:
        # Random bf16 values in +-[0.5, 4): x * y + z is exact in fp32, so torch's result is exact.
        mantissa = 1 + torch.randint(0, 128, (N - len(cases),), generator=gen) / 128
        sign = torch.randint(0, 2, (N - len(cases),), generator=gen) * 2 - 1
        scale = 2.0 ** torch.randint(-1, 2, (N - len(cases),), generator=gen)
        return (sign * mantissa * scale).to(torch.bfloat16)

    x, y, z = (torch.cat([bf16(head), operand()]) for head in (xs, ys, zs))
    out = torch.empty(N, dtype=torch.bfloat16)
    fma_kernel[(1,)](x, y, z, out, N=N)
    exact_tail = (x.float() * y.float() + z.float()).to(torch.bfloat16)[len(cases) :]
    assert_same_bits(out, torch.cat([bf16(expected_head), exact_tail]))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # stock fp32 path: numpy warns on inf/NaN results
def test_unary_math_in_kernel() -> None:
    gen = torch.Generator().manual_seed(12)
    x = torch.cat([bf16([1.0, 4.0, 0.25, 100.0]), (torch.rand(N - 4, generator=gen) * 8 + 0.01).bfloat16()])
    out = torch.empty(5, N, dtype=torch.bfloat16)
    unary_kernel[(1,)](x, out, N=N)
    xf = x.float()
    # numpy and torch exp/log/rsqrt may differ in the last fp32 bit, which can flip a bf16 rounding
    one_ulp = {"rtol": 2**-7, "atol": 0.0}
    torch.testing.assert_close(out[0], torch.exp(xf).bfloat16(), **one_ulp)
    torch.testing.assert_close(out[1], torch.log(xf).bfloat16(), **one_ulp)
    assert_same_bits(out[2], torch.sqrt(xf).bfloat16())
    torch.testing.assert_close(out[3], torch.rsqrt(xf).bfloat16(), **one_ulp)
    y = with_random_tail([-0.0, -INF, NAN, -3.5, 0.0], seed=3)
    unary_kernel[(1,)](y, out, N=N)
    assert_same_bits(out[4], torch.abs(y))


def test_unary_builder_ops_on_bf16() -> None:
    # tl.exp & co. reject bf16 before reaching the builder; check the patched builder ops directly.
    x = (torch.rand(N, generator=torch.Generator().manual_seed(13)) * 8 + 0.01).to(torch.bfloat16)
    exact = {"create_sqrt": torch.sqrt, "create_floor": torch.floor, "create_ceil": torch.ceil}
    close = {"create_exp": torch.exp, "create_log": torch.log, "create_rsqrt": torch.rsqrt}
    for name, ref in exact.items():
        assert_same_bits(bf16_from_handle(getattr(interpreter_builder, name)(bf16_handle(x))), ref(x))
    for name, ref in close.items():
        got = bf16_from_handle(getattr(interpreter_builder, name)(bf16_handle(x)))
        torch.testing.assert_close(got, ref(x.float()).bfloat16(), rtol=2**-7, atol=0.0)  # 1 bf16 ulp


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_builder_ops_on_every_bf16_value() -> None:
    # Every bf16 bit pattern (subnormals, infs, NaNs included) against a shuffled partner. Signalling
    # NaNs are quieted: torch's fmax/fmin follow IEEE 754-2008 maxNum there and return NaN.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32)
    signalling = ((bits & 0x7FC0) == 0x7F80) & ((bits & 0x3F) != 0)
    x = torch.where(signalling, bits | 0x40, bits).to(torch.int16).view(torch.bfloat16)
    y = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(15))]
    hx, hy = bf16_handle(x), bf16_handle(y)
    b = interpreter_builder
    binary = {
        "create_fadd": torch.add,
        "create_fsub": torch.sub,
        "create_fmul": torch.mul,
        "create_fdiv": torch.div,
        "create_maxnumf": torch.fmax,
        "create_minnumf": torch.fmin,
        "create_maximumf": torch.maximum,
        "create_minimumf": torch.minimum,
    }
    for name, ref in binary.items():
        got = bf16_from_handle(getattr(b, name)(hx, hy))
        expected = ref(x, y)
        if "max" in name or "min" in name:  # the sign of a zero result is unspecified for +-0 pairs
            got, expected = got + 0, expected + 0
        assert_same_bits(got, expected)
    for name, ref in {
        "create_fcmpOLT": torch.lt,
        "create_fcmpOEQ": torch.eq,
        "create_fcmpUNE": torch.ne,
    }.items():
        assert np.array_equal(getattr(b, name)(hx, hy).data, ref(x, y).numpy()), name
    widened = b.create_fp_ext(hx, tl.float32)
    assert_same_bits(torch.from_numpy(widened.data), x.float())
    fp32 = torch.randint(-(2**31), 2**31 - 1, (2**16,), generator=torch.Generator().manual_seed(16))
    fp32 = fp32.to(torch.int32).view(torch.float32)
    narrowed = b.create_fp_trunc(TensorHandle(fp32.numpy(), tl.float32), tl.bfloat16)
    assert_same_bits(bf16_from_handle(narrowed), fp32.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_maximum_minimum_clamp_nan(dtype: torch.dtype) -> None:
    head_x = [NAN, 1.0, NAN, -3.0, -1.0, -2.0, 5.0, NAN, -7.5]
    head_y = [2.0, NAN, NAN, -2.0, 1.0, -3.0, -5.0, -1.0, 0.5]
    x = with_random_tail(head_x, seed=4).to(dtype)
    y = with_random_tail(head_y, seed=5).to(dtype)
    lo = torch.full((N,), -1.5, dtype=dtype)
    hi = torch.full((N,), 2.5, dtype=dtype)
    lo[5] = NAN  # a NaN bound: ignored by clamp's default, propagated by PropagateNan.ALL
    out = torch.empty(6, N, dtype=dtype)
    minmax_kernel[(1,)](x, y, lo, hi, out, N=N)
    # GPU: maxnum/minnum (default) return the non-NaN operand, maximum/minimum propagate NaN.
    assert_same_bits(out[0], torch.fmax(x, y))
    assert_same_bits(out[1], torch.fmin(x, y))
    assert_same_bits(out[2], torch.maximum(x, y))
    assert_same_bits(out[3], torch.minimum(x, y))
    assert_same_bits(out[4], torch.fmin(torch.fmax(x, lo), hi))
    assert_same_bits(out[5], torch.minimum(torch.maximum(x, lo), hi))


def test_comparisons_and_where() -> None:
    # -0.0 == 0.0 and the ordering of negative values are wrong on raw bit patterns.
    x = with_random_tail([-0.0, -3.0, -1.0, NAN, 1.0, NAN, -2.0, 2.0], seed=6)
    y = with_random_tail([0.0, -2.0, 1.0, 1.0, NAN, NAN, -2.0, -2.0], seed=7)
    cmp = torch.empty(6, N, dtype=torch.int8)
    where = torch.empty(2, N, dtype=torch.bfloat16)
    compare_where_kernel[(1,)](x, y, cmp, where, N=N)
    for row, expected in enumerate([x < y, x <= y, x > y, x >= y, x == y, x != y]):
        assert torch.equal(cmp[row], expected.to(torch.int8)), f"comparison row {row}"
    assert_same_bits(where[0], torch.where(x > y, x, y))
    point_one = torch.tensor(0.1).to(torch.bfloat16)  # round to nearest even, not truncation
    assert_same_bits(where[1], torch.where(x < 0, point_one, x))


def test_bf16_dot_accumulates_in_fp32() -> None:
    M, K, Nc = 16, 32, 16
    gen = torch.Generator().manual_seed(8)
    # Small integers: every product and partial sum is exact in fp32, so the result must be too.
    a = torch.randint(-8, 8, (M, K), generator=gen).to(torch.bfloat16)
    b = torch.randint(-8, 8, (K, Nc), generator=gen).to(torch.bfloat16)
    acc = torch.randint(-100, 100, (M, Nc), generator=gen).float()
    out = torch.empty(M, Nc)
    dot_kernel[(1,)](a, b, acc, out, M=M, K=K, N=Nc)
    assert torch.equal(out, a.float() @ b.float() + acc)
    # General values: fp32 accuracy (summation order may differ).
    a = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    b = torch.randn(K, Nc, generator=gen).to(torch.bfloat16)
    acc = torch.randn(M, Nc, generator=gen)
    dot_kernel[(1,)](a, b, acc, out, M=M, K=K, N=Nc)
    torch.testing.assert_close(out, a.float() @ b.float() + acc, rtol=1e-5, atol=1e-5)


def test_fp32_to_bf16_rounds_to_nearest_even() -> None:
    ties_and_edges = [
        1 + 2**-8,  # halfway between 1.0 and 1 + 2**-7: to even, 1.0
        1 + 3 * 2**-8,  # halfway: to even, 1 + 2**-6 (truncation gives 1 + 2**-7)
        -(1 + 3 * 2**-8),
        1 + 2**-8 + 2**-23,  # just above halfway: up
        1 + 2**-8 - 2**-23,  # just below halfway: down
        0.1,
        3.3895313892515355e38,  # largest bf16: kept
        3.4028234663852886e38,  # largest fp32: rounds to inf
        INF,
        -INF,
        NAN,
    ]
    head = torch.tensor(ties_and_edges, dtype=torch.float32)
    odd_bits = fp32_from_bits([0x7F800001, 0x00008000, 0x00018000, 0x80008000])  # sNaN, subnormal ties
    tail = torch.randn(N - len(head) - len(odd_bits), generator=torch.Generator().manual_seed(14)) * 100
    x = torch.cat([head, odd_bits, tail])
    out = torch.empty(3, N, dtype=torch.bfloat16)
    downcast_kernel[(1,)](x, out, N=N)
    assert out[0, :3].tolist() == [1.0, 1.015625, -1.015625]
    assert out[0, 11].isnan()  # truncating 0x7F800001 would give inf
    assert_same_bits(out[0], x.to(torch.bfloat16))
    assert_same_bits(out[1], x.to(torch.bfloat16))
    truncated = (x.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    assert_same_bits(out[2], torch.where(x.isnan(), x.to(torch.bfloat16), truncated))


def test_fp64_to_bf16_rounds_once() -> None:
    # Rounding to fp32 first would land exactly halfway and round down to 1.0.
    x = torch.tensor([1 + 2**-8 + 2**-40, -(1 + 2**-8 + 2**-40), 1e300, -1e300, 1e-300], dtype=torch.float64)
    x = torch.cat([x, torch.zeros(N - len(x), dtype=torch.float64)])
    out = torch.empty(3, N, dtype=torch.bfloat16)
    downcast_kernel[(1,)](x, out, N=N)
    bf16_max = 3.3895313892515355e38
    assert out[1, :5].tolist() == [1.0078125, -1.0078125, INF, -INF, 0.0]
    assert out[2, :5].tolist() == [1.0, -1.0, bf16_max, -bf16_max, 0.0]  # rtz never overflows


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0.1, 0.1), (-3.0e-3, -3.0e-3), (INF, INF), (1e-7, 0.0)],  # 1e-7: the GPU builder prints "%f"
)
def test_bf16_constant(value: float, expected: float) -> None:
    out = torch.empty(N, dtype=torch.bfloat16)
    full_kernel[(1,)](out, VALUE=value, N=N)
    assert_same_bits(out, torch.full((N,), expected, dtype=torch.bfloat16))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e5 -> fp16 inf
def test_casts_between_bf16_int_and_fp16() -> None:
    x = with_random_tail([2.75, -2.75, 0.5, -0.5, -0.0, 100.5, -100.5, 65280.0, 1e5, 1e-7], seed=9, scale=50)
    ints = torch.tensor([257, 259, -259, 0, 1, -1, 65535, 16777215, *range(-12, 12)], dtype=torch.int32)
    to_int = torch.empty(N, dtype=torch.int32)
    from_int = torch.empty(N, dtype=torch.bfloat16)
    to_fp16 = torch.empty(N, dtype=torch.float16)
    cast_kernel[(1,)](x, ints, to_int, from_int, to_fp16, N=N)
    assert torch.equal(to_int, x.to(torch.int32))  # truncation toward zero of the real value
    assert from_int[:3].tolist() == [256.0, 260.0, -260.0]  # ties to even
    assert_same_bits(from_int, ints.to(torch.bfloat16))
    assert_same_bits(to_fp16, x.to(torch.float16))  # 1e5 -> inf, 1e-7 -> fp16 subnormal


def reduction_input(rows: int) -> torch.Tensor:
    """Distinct multiples of 1/8 in [-16, 16): fp32 sums of them are exact, maxima unique."""
    gen = torch.Generator().manual_seed(10)
    values = (torch.randperm(256, generator=gen)[: rows * N] - 128) / 8
    return values.reshape(rows, N).to(torch.bfloat16)


def test_sum_max_min_argmax_argmin_cumsum() -> None:
    R = 4
    x = reduction_input(R)
    x[0] = -x[0].abs()  # an all-negative row
    sums, mins = torch.empty(R, dtype=torch.bfloat16), torch.empty(R)
    maxs = torch.empty(R)
    argmax, argmin = torch.empty(R, dtype=torch.int32), torch.empty(R, dtype=torch.int32)
    cumsum = torch.empty(R, N, dtype=torch.bfloat16)
    reduce_kernel[(1,)](x, sums, maxs, mins, argmax, argmin, cumsum, R=R, N=N)
    # fp32 accumulation, one rounding to bf16 (exact here, so bitwise)
    assert_same_bits(sums, x.float().sum(dim=1).to(torch.bfloat16))
    assert_same_bits(cumsum, x.float().cumsum(dim=1).to(torch.bfloat16))
    assert torch.equal(maxs, x.float().amax(dim=1))  # tl.max of bf16 returns fp32
    assert torch.equal(mins, x.float().amin(dim=1))
    assert torch.equal(argmax, x.argmax(dim=1).to(torch.int32))
    assert torch.equal(argmin, x.argmin(dim=1).to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_argmin_over_a_nan_follow_the_gpus_combine_not_torchs_rule(dtype: torch.dtype) -> None:
    """torch (and numpy, the stock interpreter) give a NaN's index; the GPU's pairwise combine
    (a > b, NaN comparing false) does not: a kernel leaving NaN to tl.argmax must fail on CPU too."""
    R = 4
    x = reduction_input(R).to(dtype)
    x[:, 5] = NAN
    sums, maxs, mins = torch.empty(R, dtype=dtype), torch.empty(R), torch.empty(R)
    argmax, argmin = torch.empty(R, dtype=torch.int32), torch.empty(R, dtype=torch.int32)
    cumsum = torch.empty(R, N, dtype=dtype)
    reduce_kernel[(1,)](x, sums, maxs, mins, argmax, argmin, cumsum, R=R, N=N)
    assert x.argmax(dim=1).tolist() == [5] * R  # torch's rule
    assert 5 not in argmax.tolist() and 5 not in argmin.tolist()  # in this tree the NaN at 5 loses
    assert torch.equal(maxs, x.float().nan_to_num(-INF).amax(dim=1))  # tl.max ignores NaN (maxnum)


def test_the_pairwise_arg_reduce_without_nan_is_numpys_lowest_index_rule() -> None:
    from ops.interpreter_compat import _tree_arg_reduce

    data = np.random.default_rng(3).integers(0, 5, size=(6, 37)).astype(np.float32)  # many ties
    for larger, pick in ((True, np.argmax), (False, np.argmin)):
        _, idx = _tree_arg_reduce(data, axis=1, larger=larger)
        assert np.array_equal(idx, pick(data, axis=1))


def test_sum_of_general_values_within_one_rounding() -> None:
    R = 4
    x = torch.randn(R, N, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    sums, maxs, mins = torch.empty(R, dtype=torch.bfloat16), torch.empty(R), torch.empty(R)
    argmax, argmin = torch.empty(R, dtype=torch.int32), torch.empty(R, dtype=torch.int32)
    cumsum = torch.empty(R, N, dtype=torch.bfloat16)
    reduce_kernel[(1,)](x, sums, maxs, mins, argmax, argmin, cumsum, R=R, N=N)
    torch.testing.assert_close(sums.float(), x.float().sum(dim=1), rtol=2**-8, atol=1e-6)


def test_scans() -> None:
    # Few significant bits per value, so every fp32 prefix product and sum is exact.
    x = bf16([1.5, -2.0, 1.25, 3.0, -0.5, 2.0, 1.125, -1.0] * 2)
    out = torch.empty(3, len(x), dtype=torch.bfloat16)
    scan_kernel[(1,)](x, out, N=len(x))
    assert_same_bits(out[0], x.float().cumprod(0).to(torch.bfloat16))
    assert_same_bits(out[1], x.float().flip(0).cumsum(0).flip(0).to(torch.bfloat16))
    expected = [x[0]]
    for value in x[1:]:  # the generic scan rounds each bf16 add, left to right
        expected.append(expected[-1] + value)
    assert_same_bits(out[2], torch.stack(expected))


def test_generic_reduce_paths() -> None:
    R = 2
    x = reduction_input(R)
    adds = torch.empty(R, dtype=torch.bfloat16)
    maxs = torch.empty(R, dtype=torch.bfloat16)
    generic_reduce_kernel[(1,)](x, adds, maxs, R=R, N=N)
    expected = x[:, 0]
    for j in range(1, N):  # the interpreter combines left to right, rounding each bf16 add
        expected = expected + x[:, j]
    assert_same_bits(adds, expected)
    assert_same_bits(maxs, x.amax(dim=1))
