"""What the model-level CLIs share: resolving ``--model``, parsing ``--inject``, building both models."""

from __future__ import annotations

import functools
import os
import random
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import registry
from model import config as model_config
from model import reference, triton_model
from model import weights as model_weights
from model.decoder import FUSED_PARTS, FUSIONS, OPS, Decoder
from verify import impl_loader
from verify.cli import UsageError
from verify.watchdog import HANG, NO_LIMIT, Watchdog, device_lost, wait_for_device

# ops the decoder calls only outside its layers (embedding, the RoPE table, the greedy pick):
# --inject swaps ops in layers, so these cannot be injected
OUTSIDE_LAYERS = ("embedding", "rope_cos_sin", "argmax")
INJECTABLE = tuple(op for op in OPS if op not in OUTSIDE_LAYERS)


class InjectedOpError(Exception):
    """An injected implementation raised: the implementation under test failed (the CLIs exit 1,
    as ``verify.op`` reports an implementation that raises as a divergence). ``where`` is the end
    of its traceback, as verify.op prints it, so the failing line of the user's code is shown."""

    def __init__(self, message: str, cause: BaseException, where: str | None = None) -> None:
        super().__init__(message)
        self.where = impl_loader.failure_site(cause) if where is None else where


@dataclass(frozen=True)
class Injection:
    """One ``--inject OP=IMPL@LAYERS``: an outside implementation swapped into the Triton model."""

    op: str
    impl_spec: str
    layers: tuple[int, ...] | None  # None: all layers

    @property
    def layer_spec(self) -> str | list[int]:
        """The layers as the reports print them: "all" or the numbers."""
        return "all" if self.layers is None else list(self.layers)

    def as_json(self) -> dict:
        """As the JSON reports record it: a report from an injected run says so."""
        return {"op": self.op, "impl": self.impl_spec, "layers": self.layer_spec}


def cache_rows(
    cache_len: int | None, needed: int, what: str, config: model_config.ModelConfig, device: torch.device
) -> int:
    """The KV cache capacity for a run needing ``needed`` rows (``what`` says of what), checked
    before any cache exists: at least ``needed``, at most the config's positions, and one bf16
    cache of it (the run holds several) within the memory free on ``device``: a huge request is
    refused by name, not left to the allocator's traceback."""
    limit = config.max_position_embeddings
    if needed > limit:
        raise UsageError(
            f"{what} need {needed} positions, more than the model's max_position_embeddings {limit}"
        )
    if cache_len is not None and cache_len < needed:
        raise UsageError(f"--cache-len {cache_len}: {what} need {needed} rows")
    if cache_len is not None and cache_len > limit:
        raise UsageError(f"--cache-len {cache_len}: exceeds the model's max_position_embeddings {limit}")
    rows = needed if cache_len is None else cache_len
    cache_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2 * rows  # K and V, bf16
    free = free_memory(device)
    if cache_bytes > free:
        asked = what if cache_len is None else f"--cache-len {cache_len}"
        raise UsageError(
            f"{asked}: a KV cache of {rows} rows takes {cache_bytes / 2**30:,.1f} GiB, more than the "
            f"{free / 2**30:,.1f} GiB free on {device}"
        )
    return rows


def free_memory(device: torch.device) -> int:
    """Bytes the allocator can still get on ``device``: the GPU's free memory, or the host's
    available memory (``MemAvailable``; free pages where there is no /proc)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def parse_injection(text: str) -> Injection:
    """``OP=IMPL@LAYERS``: LAYERS is a number, a comma list or ``all``."""
    op, sep, rest = text.partition("=")
    impl, at, layers = rest.rpartition("@")
    if not sep or not at or not op or not impl or not layers:
        raise UsageError(f"--inject {text!r}: expected OP=IMPL@LAYERS, e.g. rms_norm=my_norms.py:rms_norm@3")
    if op in OUTSIDE_LAYERS:
        raise UsageError(
            f"--inject {text!r}: {op} runs outside the layers; injectable: {', '.join(INJECTABLE)}"
        )
    if op not in OPS:
        raise UsageError(f"--inject {text!r}: unknown op {op!r}; injectable: {', '.join(INJECTABLE)}")
    if layers == "all":
        return Injection(op, impl, None)
    if not all(re.fullmatch(r"-?[0-9]+", n) for n in layers.split(",")):  # int() takes "1_0", " 1", "１"
        raise UsageError(f"--inject {text!r}: layers must be a number, a comma list or 'all'")
    numbers = tuple(int(n) for n in layers.split(","))
    twice = next((n for i, n in enumerate(numbers) if n in numbers[:i]), None)
    if twice is not None:  # not "already injected" by itself, as a second --inject would be
        raise UsageError(f"--inject {text!r}: layer {twice} is listed twice")
    return Injection(op, impl, numbers)


def apply_injections(model: Decoder, injections: list[Injection], watchdog: Watchdog = NO_LIMIT) -> None:
    """``@all`` means every layer. One op of one layer takes one injection: a second would win
    silently while the report names both. ``watchdog`` watches each call of an injected op (its
    subject: the :class:`Injection`), so one that hangs ends the run with a report. Python's and
    numpy's global generators are seeded (torch's starts from a fixed seed): an injected op that
    draws from them draws the same numbers every run."""
    random.seed(0)
    np.random.seed(0)
    taken: dict[tuple[str, int], str] = {}
    for inj in injections:
        layers = list(range(model.config.num_layers)) if inj.layers is None else list(inj.layers)
        bad = [n for n in layers if not 0 <= n < model.config.num_layers]
        if bad:
            raise UsageError(
                f"--inject {inj.op}: layer {bad[0]} is out of range (the model has {model.config.num_layers})"
            )
        for n in layers:
            if (inj.op, n) in taken:
                raise UsageError(
                    f"--inject {inj.op}={inj.impl_spec}: layer {n}'s {inj.op} is already injected "
                    f"({taken[inj.op, n]})"
                )
            taken[inj.op, n] = inj.impl_spec
        try:
            option = f"--inject {inj.op}={inj.impl_spec}"
            fn = impl_loader.load(inj.impl_spec, option, default_fn=inj.op, timeout=watchdog.seconds)
            impl_loader.check_signature(fn, registry.get(inj.op).reference, inj.op, option)
        except impl_loader.ImplError as exc:
            raise UsageError(str(exc)) from None
        try:
            model.inject(inj.op, _guarded(fn, inj, watchdog), layers)
        except ValueError as exc:
            raise UsageError(f"--inject {inj.op}: {exc}") from None


def _guarded(fn: Callable, inj: Injection, watchdog: Watchdog) -> Callable:
    """``fn``, its exceptions turned into :class:`InjectedOpError` naming the injection, a GPU
    fault of its launches included (it waits for them), each call under ``watchdog`` (the
    signature stays visible through ``functools.wraps``: the decoder asks whether it takes ``out``)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            with watchdog.watching(inj):
                result = fn(*args, **kwargs)
                wait_for_device()
            return result
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # sys.exit(0) or os._exit(0) inside it is no verdict
            if device_lost():  # raised by the wait: its traceback shows the wait, not the kernel
                text = impl_loader.exception_text(exc)
                fault = text.splitlines()[0] if text else type(exc).__name__
                raise InjectedOpError(
                    f"the injected {inj.op} ({inj.impl_spec}) faulted the GPU: {fault} (in one of its "
                    "launches, which CUDA_LAUNCH_BLOCKING=1 names); the device is lost: the run stops here",
                    exc,
                    where="",
                ) from exc
            raised = f"{type(exc).__name__}: {impl_loader.exception_text(exc)}"
            raise InjectedOpError(f"the injected {inj.op} ({inj.impl_spec}) raised {raised}", exc) from exc

    return call


def hang_message(inj: Injection, seconds: float) -> str:
    """What the CLIs report when a call of an injected op runs past ``--timeout``."""
    return f"the injected {inj.op} ({inj.impl_spec}) did not return within {seconds:g} s (--timeout): {HANG}"


def resolve_checkpoint(model: str | None) -> Path:
    """The checkpoint directory for ``--model``: the embedded default, a directory, or a preset."""
    if model is None:
        from model import embedded

        try:
            return embedded.ensure()
        except ImportError as exc:
            raise UsageError(f"--model not given: {exc}") from None
    if model in model_config.PRESETS:
        from model import presets

        note = slow_run_note(model)
        if note:
            print(note, file=sys.stderr)
        return presets.checkpoint(model)
    if not model.strip():  # Path("") is the working directory: never what an empty argument meant
        raise UsageError("--model: the name is empty, expected a checkpoint directory or a preset")
    path = Path(model)
    if not path.exists():
        raise UsageError(
            f"--model {model}: no such directory, and not a preset ({', '.join(model_config.PRESETS)})"
        )
    if not path.is_dir():
        raise UsageError(f"--model {model}: expected a checkpoint directory (config.json + safetensors)")
    return path


def slow_run_note(preset: str) -> str | None:
    """A warning before a full-size preset is built and run on the interpreter: it takes hours."""
    from ops import backend

    params = model_config.PRESETS[preset].num_parameters()
    if not backend.is_interpreter() or params < 10**8:
        return None
    return f"note: --model {preset} has {params / 1e9:.2f}B parameters: the Triton interpreter takes hours"


def checkpoint_config(model: str | None) -> tuple[Path, model_config.ModelConfig]:
    """The checkpoint directory for ``--model`` and its parsed config, read before anything is
    built: the request's sizes are checked against it first."""
    directory = resolve_checkpoint(model)
    try:
        return directory, model_config.load(directory)
    except model_config.ConfigError as exc:
        raise UsageError(f"--model: {exc}") from None


def requested_config(model: str | None) -> model_config.ModelConfig:
    """The config ``--model`` names, without building anything: the embedded default's and a
    preset's are known before their checkpoints exist, so a request is refused before one is
    trained or written (then :func:`checkpoint_config` builds it)."""
    if model is None:
        from model import embedded

        return model_config.from_hf_dict(embedded.tiny_config(embedded.DEFAULT_FAMILY))
    if model in model_config.PRESETS:
        return model_config.PRESETS[model]
    return checkpoint_config(model)[1]


@dataclass
class Models:
    """A checkpoint loaded once, with the reference and Triton decoders over its weights."""

    directory: Path
    config: model_config.ModelConfig
    weights: model_weights.Weights
    reference: Decoder
    triton: Decoder


def load(
    directory: Path,
    cfg: model_config.ModelConfig,
    device: torch.device,
    max_batch: int,
    max_seq: int,
    injections: Sequence[Injection] = (),
    watchdog: Watchdog = NO_LIMIT,
) -> Models:
    """The reference and Triton decoders over one copy of the weights of the checkpoint that
    :func:`checkpoint_config` resolved, with the injections applied to the Triton one (each
    call of one under ``watchdog``)."""
    try:
        weights = model_weights.load(directory, cfg, device)
    except model_weights.WeightsError as exc:
        raise UsageError(f"--model: {exc}") from None
    fused = decoder_fused(injections)
    ref = reference.build(weights, max_batch, max_seq, fused)
    tri = triton_model.build(weights, max_batch, max_seq, fused)
    apply_injections(tri, list(injections), watchdog)
    return Models(directory, cfg, weights, ref, tri)


def decoder_fused(injections: Sequence[Injection]) -> bool:
    """Fused ops unless an injection swaps one of their parts (then both models run the parts)."""
    swapped = {inj.op for inj in injections}
    if swapped & FUSED_PARTS and swapped & set(FUSIONS):
        raise UsageError(
            f"--inject: {', '.join(sorted(swapped & set(FUSIONS)))} is a fused op and "
            f"{', '.join(sorted(swapped & FUSED_PARTS))} one of the ops fused ops stand for; the decoder "
            "runs either the fused ops or their parts, so inject one kind"
        )
    return not swapped & FUSED_PARTS


def describe_ops(models: Models) -> str:
    model = models.triton
    if model.fused:
        called = set(model.layer_ops())
        return f"fused ops ({', '.join(op for op in FUSIONS if op in called)})"
    return "unfused ops (an --inject swaps a part of a fused op)"
