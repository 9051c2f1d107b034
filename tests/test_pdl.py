"""The programmatic-dependent-launch contract, checked on the source (it only runs on a GPU).

A kernel launched with PDL may start while the kernel before it is still writing; if it read
or wrote memory before ``pdl.wait`` it would race, and only sometimes, only on Hopper. So every
kernel in ``ops/`` must take ``PDL``, call ``pdl.wait(PDL)`` unconditionally at the top level
of its body, touch no memory before that call, and every launch must pass the PDL options.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parent.parent / "ops"
MEMORY_OPS = {"load", "store", "atomic_add", "atomic_cas", "atomic_xchg", "atomic_max", "atomic_min"}


def _kernels() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(OPS.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            is_kernel = isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
            if is_kernel and any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list):
                found.append((f"{path.name}:{node.name}", node))
    return found


def _is_call(node: ast.AST, dotted: str) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func) == dotted


def _touches_memory(statement: ast.stmt) -> str | None:
    """The first call in ``statement`` that may read or write memory, or None."""
    for node in ast.walk(statement):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name.startswith("tl.") and name.split(".")[-1] in MEMORY_OPS:
            return name
        casts = isinstance(node.func, ast.Attribute) and node.func.attr == "to"
        # pdl's helpers (wait, release, prefetch_l2: an L2 hint) move no data into the program
        if not name.startswith(("tl.", "pdl.")) and name not in {"min", "max"} and not casts:
            return name  # a helper: it may load
    return None


KERNELS = _kernels()


def test_the_kernels_are_found() -> None:
    names = {name.split(":")[1] for name, _ in KERNELS}
    assert {"_gemv_kernel", "_tiled_kernel", "_decode_split_kernel", "_rope_kv_store_kernel"} <= names


@pytest.mark.parametrize("name,kernel", KERNELS, ids=[name for name, _ in KERNELS])
def test_kernel_waits_before_touching_memory(name: str, kernel: ast.FunctionDef) -> None:
    assert "PDL" in [a.arg for a in kernel.args.args], f"{name} takes no PDL constexpr"
    body = [s for s in kernel.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    waits = [i for i, s in enumerate(body) if isinstance(s, ast.Expr) and _is_call(s.value, "pdl.wait")]
    assert waits, f"{name} has no top-level pdl.wait(PDL): a branch could skip it"
    for statement in body[: waits[0]]:
        if _is_early_weight_load(statement):
            continue
        touched = _touches_memory(statement)
        assert touched is None, f"{name} calls {touched} before pdl.wait (line {statement.lineno})"


WEIGHT_POINTERS = {"w_ptrs", "w_piece1_ptrs", "w_piece2_ptrs"}  # a gemv's weight chunk, K pieces


def _is_early_weight_load(statement: ast.stmt) -> bool:
    """The one read the contract lets through: ``if EARLY_WEIGHT:`` whose only memory calls are
    ``tl.load`` of the weight's pointers (a weight the caller promised no running kernel writes)."""
    if not (isinstance(statement, ast.If) and ast.unparse(statement.test) == "EARLY_WEIGHT"):
        return False
    calls = [node for node in ast.walk(statement) if isinstance(node, ast.Call)]
    touching = [node for node in calls if _touches_memory(ast.Expr(node)) is not None]
    return all(
        _is_call(node, "tl.load") and ast.unparse(node.args[0]) in WEIGHT_POINTERS for node in touching
    )


def test_the_early_weight_exception_is_narrow() -> None:
    """Only weight loads pass under ``EARLY_WEIGHT``: a store or another pointer there fails."""
    allowed = ast.parse("if EARLY_WEIGHT:\n    w = tl.load(w_ptrs, mask=m)\nelse:\n    w = None").body[0]
    assert _is_early_weight_load(allowed)
    pieces = "if EARLY_WEIGHT:\n    w = tl.load(w_ptrs)\n    if P:\n        p = tl.load(w_piece1_ptrs)"
    assert _is_early_weight_load(ast.parse(pieces).body[0])
    for source in (
        "if EARLY_WEIGHT:\n    x = tl.load(x_ptrs)",
        "if EARLY_WEIGHT:\n    tl.store(w_ptrs, 0)",
        "if EARLY_WEIGHT:\n    w = helper(w_ptrs)",
        "if EARLY_WEIGHT:\n    w = tl.load(w_ptrs)\n    if P:\n        x = tl.load(x_piece1_ptrs)",
        "if OTHER:\n    w = tl.load(w_ptrs)",
    ):
        assert not _is_early_weight_load(ast.parse(source).body[0]), source


def test_every_launch_passes_the_pdl_options() -> None:
    for path in sorted(OPS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            launched = isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
            if launched and ast.unparse(node.func.value).endswith("_kernel"):
                options = [
                    k for k in node.keywords if k.arg is None and "pdl.launch_options" in ast.unparse(k)
                ]
                assert options, f"{path.name}:{node.lineno} launches without **pdl.launch_options()"
