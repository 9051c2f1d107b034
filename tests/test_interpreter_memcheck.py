"""``ops.interpreter_memcheck``: under the interpreter, an access outside a kernel's tensors, or a
race between its programs, raises.

Without it the interpreter reads or writes the process's own memory at such an address: a few
elements off it reads junk (which a kernel may even discard, and pass), far off it crashes. And it
runs a launch's programs in order, so a program reading what another stored gets the same answer
every time, where the GPU's order is not set.
"""

from __future__ import annotations

import pytest
import torch

from ops import backend

if not backend.is_interpreter():
    pytest.skip("ops.interpreter_memcheck checks the Triton interpreter only", allow_module_level=True)

import triton
import triton.language as tl

import registry
from ops import interpreter_memcheck
from ops.interpreter_memcheck import OutOfBounds, Race
from tests import buggy_kernels
from verify.compare import check


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, OFFSET: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    if MASKED:
        x = tl.load(x_ptr + cols + OFFSET, mask=cols < n, other=0.0)
    else:
        x = tl.load(x_ptr + cols + OFFSET)
    tl.store(y_ptr + cols, x, mask=cols < n)


@triton.jit
def _store_kernel(y_ptr, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    tl.store(y_ptr + tl.arange(0, BLOCK) + OFFSET, tl.full((BLOCK,), 7.0, tl.float32))


@triton.jit
def _atomic_kernel(y_ptr, OFFSET: tl.constexpr):
    tl.atomic_add(y_ptr + OFFSET, 1.0)


@triton.jit
def _descriptor_copy_kernel(x_ptr, y_ptr, M, N: tl.constexpr, BLOCK_M: tl.constexpr):
    desc = tl.make_tensor_descriptor(x_ptr, [M, N], [N, 1], [BLOCK_M, N])
    tile = desc.load([0, 0])
    tl.store(y_ptr + tl.arange(0, BLOCK_M)[:, None] * N + tl.arange(0, N)[None, :], tile)


def test_a_tensor_descriptor_load_is_checked_not_broken() -> None:
    """Triton's descriptor load calls the masked load with keywords: the check passes them on."""
    x, y = torch.arange(32, dtype=torch.float32).reshape(4, 8), torch.zeros(4, 8)
    _descriptor_copy_kernel[(1,)](x, y, 4, N=8, BLOCK_M=4)
    assert torch.equal(x, y)


def _copy(offset: int, masked: bool, n: int = 12, block: int = 16) -> torch.Tensor:
    x, y = torch.arange(32, dtype=torch.float32)[:n].clone(), torch.zeros(n)
    _copy_kernel[(1,)](x, y, n, OFFSET=offset, MASKED=masked, BLOCK=block)
    return y


def test_accesses_inside_the_tensors_or_masked_off_pass() -> None:
    assert torch.equal(_copy(0, masked=True), torch.arange(12.0))  # lanes 12-15 lie past x, masked off
    assert torch.equal(_copy(0, masked=False, n=16), torch.arange(16.0))


OUTSIDE = "a load of {} of 16 addresses outside every tensor it was passed"


@pytest.mark.parametrize(
    ("offset", "where"),
    [
        (0, OUTSIDE.format(4) + "; the first just past the end of x_ptr"),
        (-3, OUTSIDE.format(4) + "; the first 12 bytes before x_ptr"),
        (1 << 40, OUTSIDE.format(16) + "; the first 4.0 TiB past the end of"),  # unchecked, it would crash
    ],
)
def test_an_unmasked_load_outside_the_tensors_raises_naming_the_kernel(offset: int, where: str) -> None:
    with pytest.raises(triton.runtime.errors.InterpreterError) as raised:
        _copy(offset, masked=False)
    cause = raised.value.__cause__
    assert isinstance(cause, OutOfBounds)
    assert str(cause).startswith(f"_copy_kernel, program (0, 0, 0): {where}")


def test_a_store_outside_raises_before_writing() -> None:
    y = torch.zeros(24)
    _store_kernel[(1,)](y, OFFSET=8, BLOCK=16)
    assert torch.equal(y[8:], torch.full((16,), 7.0))
    y.zero_()
    with pytest.raises(triton.runtime.errors.InterpreterError, match="a store of 4 of 16 addresses"):
        _store_kernel[(1,)](y, OFFSET=12, BLOCK=16)
    assert not y.any()  # nothing was written: the check runs before the access


def test_a_store_past_a_view_inside_its_storage_raises() -> None:
    """On the GPU the caching allocator packs tensors into one allocation, so a write past a view's
    end lands in its neighbour without a fault; the check holds a kernel to the view it was passed."""
    buffer = torch.zeros(24)
    with pytest.raises(triton.runtime.errors.InterpreterError) as raised:
        _store_kernel[(1,)](buffer[:8], OFFSET=0, BLOCK=16)
    assert (
        "a store of 8 of 16 addresses outside every tensor it was passed; the first just past the end "
        in str(raised.value.__cause__)
    )
    assert not buffer.any()


def test_an_access_between_a_strided_views_elements_raises() -> None:
    matrix = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    column_pair = matrix[:, :2]  # rows 8 floats apart: 6 floats of each row are not the view's
    y = torch.zeros(16)
    _copy_kernel[(1,)](column_pair, y, 2, OFFSET=8, MASKED=True, BLOCK=2)  # row 1's pair
    assert y[:2].tolist() == [8.0, 9.0]
    with pytest.raises(triton.runtime.errors.InterpreterError) as raised:
        _copy_kernel[(1,)](column_pair, y, 3, OFFSET=8, MASKED=True, BLOCK=4)
    assert str(raised.value.__cause__).endswith(
        "a load of 1 of 3 addresses outside every tensor it was passed; the first 40 bytes into x_ptr's "
        "span, between its elements (a strided view)"
    )


def test_an_atomic_outside_raises() -> None:
    y = torch.zeros(4)
    _atomic_kernel[(1,)](y, OFFSET=3)
    with pytest.raises(triton.runtime.errors.InterpreterError, match="an atomic of 1 of 1 addresses"):
        _atomic_kernel[(1,)](y, OFFSET=4)


def test_a_kernel_reading_its_tail_unmasked_fails_only_through_the_memcheck(monkeypatch) -> None:
    """The planted kernel discards what it read past the row, so its values are right: without the
    memcheck the case passes on CPU, while on the GPU the same reads can fault."""
    spec = registry.get("rms_norm")
    case = spec.build({**spec.typical, "n": 3, "lead": [1], "pad": 0}, backend.device())
    result = check(spec, case, buggy_kernels.rms_norm_tail_loaded_unmasked)
    assert not result.passed and "OutOfBounds" in result.error
    assert "just past the end of x_ptr" in result.error
    assert "in _rms_norm_kernel" in result.error  # the report shows the kernel's line, not the interpreter's
    monkeypatch.setattr(interpreter_memcheck, "_check", lambda *args: None)
    assert check(spec, case, buggy_kernels.rms_norm_tail_loaded_unmasked).passed


@triton.jit
def _neighbour_kernel(x_ptr, y_ptr, READ_NEXT: tl.constexpr, WRITE_SHARED: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(x_ptr + pid, pid.to(tl.float32))
    if READ_NEXT:  # reads the slot the program before it stored
        tl.store(y_ptr + pid, tl.load(x_ptr + tl.maximum(pid - 1, 0)))
    if WRITE_SHARED:  # every program writes slot 0 of y
        tl.store(y_ptr, pid.to(tl.float32))


@triton.jit
def _ticket_kernel(x_ptr, count_ptr, y_ptr, N: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(x_ptr + pid, pid.to(tl.float32))
    if tl.atomic_add(count_ptr, 1) == N - 1:  # the last to arrive sums everyone's slots
        tl.store(y_ptr, tl.sum(tl.load(x_ptr + tl.arange(0, N)), axis=0))


def test_a_program_reading_what_another_stored_in_the_launch_is_a_race() -> None:
    x, y = torch.zeros(4), torch.zeros(4)
    _neighbour_kernel[(1,)](x, y, READ_NEXT=True, WRITE_SHARED=False)  # one program reads its own
    with pytest.raises(triton.runtime.errors.InterpreterError) as raised:
        _neighbour_kernel[(4,)](x, y, READ_NEXT=True, WRITE_SHARED=False)
    assert isinstance(raised.value.__cause__, Race)
    assert str(raised.value.__cause__).startswith(
        "_neighbour_kernel, program (1, 0, 0): a load of what program (0, 0, 0) stored earlier in this "
        "launch (0 bytes into x_ptr)"
    )


def test_two_programs_storing_the_same_bytes_is_a_race() -> None:
    x, y = torch.zeros(4), torch.zeros(4)
    with pytest.raises(triton.runtime.errors.InterpreterError, match="a store over what program"):
        _neighbour_kernel[(2,)](x, y, READ_NEXT=False, WRITE_SHARED=True)


def test_programs_ordered_through_an_atomic_are_not_judged() -> None:
    x, count, y = torch.zeros(8), torch.zeros(1, dtype=torch.int32), torch.zeros(1)
    _ticket_kernel[(8,)](x, count, y, N=8)
    assert float(y) == sum(range(8))


def test_a_one_launch_argmax_picked_by_its_last_program_fails_only_through_the_racecheck(monkeypatch) -> None:
    """The interpreter runs the last chunk's program last, so its pick sees every partial and the
    values are right; on the GPU it may run before the others have stored theirs."""
    spec = registry.get("argmax")
    case = spec.build({**spec.typical, "b": 1, "vocab": 700, "pattern": "random"}, backend.device())
    result = check(spec, case, buggy_kernels.argmax_picked_by_the_last_chunk)
    assert not result.passed and "Race" in result.error
    assert "in _argmax_last_chunk_picks_kernel" in result.error  # the kernel's line
    monkeypatch.setattr(interpreter_memcheck, "_check_races", lambda *args: None)
    assert check(spec, case, buggy_kernels.argmax_picked_by_the_last_chunk).passed
