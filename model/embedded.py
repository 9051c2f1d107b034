"""The embedded default checkpoint: a tiny Qwen-style decoder in real HF layout, built on first use.

Every CLI works with no arguments and no download because this module writes a small checkpoint
(``config.json`` + ``model.safetensors``, saved by transformers' own model class, so tensor names
are the real ones) into a local cache. Random weights would make greedy token parity a coin toss:
their top-1/top-2 logit gaps are as small as bf16 noise. So the build trains the model briefly,
on CPU in fp32, deterministically, on a copy task (a random segment repeated), after which it
continues a repetition with confident predictions; ``BUILD.json`` records the margins it reaches.
The build repeats bit for bit on one machine; torch's CPU kernels differ by instruction set, so on
another CPU it can end at slightly different weights (two builds of 2026-11-30: the same margin
at the default prompt's first step, 7.09 and 7.69 at its second). Tests rest on the margins, not
on the bytes.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

FAMILIES = ("qwen3", "qwen2", "llama")
DEFAULT_FAMILY = "qwen3"

# Bump when the build procedure changes in a way the recipe dict does not show: it is part of the
# cache key, so every cached checkpoint is rebuilt.
RECIPE_VERSION = 1

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
_FIRST_TOKEN = 3  # ids 0..2 stay special (bos is 1, eos 2): the copy task never uses them
# (training steps, fraction of them over which the lr decays) per family: qwen3's q/k norms let
# the copy circuit sharpen fastest; without them the circuit needs more steps.
_SCHEDULE = {"qwen3": (350, 0.4), "qwen2": (400, 0.3), "llama": (400, 0.3)}
_EVAL = {"prompts": 20, "new_tokens": 16, "seed": 20261129}

# Default prompts for the CLIs: a segment of distinct ids followed by the start of its repetition,
# so the trained model's greedy continuation is the rest of the repetition.
PROMPTS: tuple[tuple[int, ...], ...] = (
    (417, 73, 902, 251, 638, 19, 760, 384, 417, 73, 902, 251),
    (55, 731, 288, 946, 112, 55, 731),
    (823, 140, 507, 36, 679, 990, 261, 404, 158, 712, 597, 343, 823, 140, 507, 36, 679, 990),
)


def default_prompt() -> tuple[int, ...]:
    """The prompt the CLIs use when none is given: 8 distinct ids, then their first 4 again."""
    return PROMPTS[0]


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")


def tiny_config(family: str) -> dict:
    """The HF ``config.json`` of the tiny model, every field stated (no reliance on class defaults)."""
    _check_family(family)
    layers = 4
    cfg = {
        "architectures": [_ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": 1000,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        # transformers 5 reads rope_parameters; rope_theta stays for readers of older configs.
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",  # not torch_dtype: transformers 5 warns that it is deprecated
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
        # Qwen2's q/k/v projections always carry a bias (its modeling code hard-codes it).
        "attention_bias": family == "qwen2",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if family == "llama":
        cfg |= {"mlp_bias": False, "pretraining_tp": 1}
    else:
        cfg |= {
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": layers,
            "layer_types": ["full_attention"] * layers,
        }
    return cfg


def _recipe(family: str, steps: int | None = None) -> dict:
    """Everything that determines the checkpoint's bytes; its hash names the cache directory."""
    _check_family(family)
    return {
        "version": RECIPE_VERSION,
        "family": family,
        "config": tiny_config(family),
        "seed": 0,
        "task": {"seq_len": 64, "segment_len": [4, 16], "token_ids": [_FIRST_TOKEN, 999]},
        "steps": _SCHEDULE[family][0] if steps is None else steps,
        "batch": 32,
        "adamw": {"lr": 2e-3, "betas": [0.9, 0.98], "weight_decay": 0.0},
        "warmup_steps": 30,
        "decay_fraction": _SCHEDULE[family][1],  # lr decays linearly to 2% over the last steps
        "grad_clip": 1.0,
        # Layer 0, kv head 0 / q head 0 starts as a previous-token head (see _plant_previous_token_head).
        "prev_token_head": {"freqs": 4, "const": 0.2, "qk_norm_gain": 3.0, "score_per_freq": 24.0},
        "eval": dict(_EVAL),
    }


def _digest(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$TRITONCHECK_CACHE``, else ``~/.cache/tritoncheck``."""
    env = os.environ.get("TRITONCHECK_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tritoncheck"


def ensure(family: str = DEFAULT_FAMILY, cache_dir: Path | None = None, *, steps: int | None = None) -> Path:
    """The checkpoint directory of ``family``'s tiny model, built first if it is not cached yet.

    Safe for parallel callers (pytest-xdist workers): one builds under a file lock, into a
    temporary sibling that is renamed into place whole, so no one ever sees half a checkpoint.
    ``steps`` overrides the recipe's training steps (tests use a short run); it is part of the key.
    """
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps: expected a positive int, got {steps!r}")
    recipe = _recipe(family, steps)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"embedded-{family}-{_digest(recipe)}"
    if (target / "BUILD.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{target.name}.lock"):
        if (target / "BUILD.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            _build(recipe, tmp)
            tmp.chmod(0o755)
            try:
                os.rename(tmp, target)
            except OSError:
                if not (target / "BUILD.json").is_file():  # not a finished racer: a broken leftover
                    raise RuntimeError(f"{target} exists but holds no finished build; delete it") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock so parallel workers wait for one build instead of each training a copy."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename alone keeps racers safe
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _deterministic(seed: int) -> Iterator[None]:
    """One thread, deterministic kernels, a private RNG stream; the caller's settings come back after."""
    threads = torch.get_num_threads()
    det = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(1)  # a reduction's order must not depend on the machine's core count
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.use_deterministic_algorithms(det, warn_only=warn_only)
        torch.set_num_threads(threads)


def _hf():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: everything here is local
    try:
        import transformers
    except ModuleNotFoundError as exc:
        if exc.name != "transformers":  # installed but broken: its own error says more
            raise
        raise ImportError(
            "the embedded default model is trained with transformers, which is not installed "
            "(pip install -e '.[test]'), or pass --model DIR"
        ) from None
    transformers.utils.logging.disable_progress_bar()  # its bars would break into a CLI's table
    return transformers


def _build(recipe: dict, out: Path) -> None:
    """Train the tiny model per ``recipe``, save it in bf16 with ``save_pretrained``, measure it."""
    transformers = _hf()
    start = time.perf_counter()
    with _deterministic(recipe["seed"]):
        config = transformers.AutoConfig.for_model(**copy.deepcopy(recipe["config"]))
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            _plant_previous_token_head(model, recipe)
        losses = _train(model, recipe)
        model.to(torch.bfloat16).save_pretrained(out)
    train_s = time.perf_counter() - start
    # Restate every field: save_pretrained drops the legacy ones (rope_theta, rope_scaling).
    written = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(written | recipe["config"], indent=2, sort_keys=True) + "\n")
    report = margin_report(out)
    window = 25
    build = {
        "recipe": recipe,
        "recipe_hash": _digest(recipe),
        "seconds": {"train_and_save": round(train_s, 2), "total": round(time.perf_counter() - start, 2)},
        "loss": {
            "what": "cross-entropy on the positions the copy rule determines, mean per 25-step window",
            "first": round(losses[0], 4),
            "last": round(losses[-1], 4),
            "windows": [
                [i + window, round(sum(losses[i : i + window]) / len(losses[i : i + window]), 4)]
                for i in range(0, len(losses), window)
            ],
        },
        "margins": report,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (out / "BUILD.json").write_text(json.dumps(build, indent=2) + "\n")


def _plant_previous_token_head(model: torch.nn.Module, recipe: dict) -> None:
    """Make layer 0's first attention head attend to the previous position, content-free.

    Why: trained from scratch, the copy task sits on a loss plateau for well over a thousand
    steps until a previous-token head forms (the first half of an induction circuit); planting
    one lets the rest of the circuit form within ~200 steps, inside a CPU build's budget.
    Token embeddings get a constant coordinate 0 (a constant logit shift under the tied head,
    so harmless); q and k of that head read only it, so they are the same at every position,
    and RoPE turns q.k into a function of the distance d alone: sum_f cos((d - 1) theta_f)
    over the fastest ``freqs`` frequencies, largest at d = 1.
    """
    cfg, p = recipe["config"], recipe["prev_token_head"]
    dim, half = cfg["head_dim"], cfg["head_dim"] // 2
    theta = cfg["rope_theta"] ** (-torch.arange(half, dtype=torch.float64) * 2 / dim)  # HF's inv_freq
    f = p["freqs"]
    q = torch.zeros(dim, dtype=torch.float64)
    k = torch.zeros(dim, dtype=torch.float64)
    q[:f], q[half : half + f] = torch.cos(theta[:f]), -torch.sin(theta[:f])  # rotate_half pairs (i, i+half)
    k[:f] = 1.0
    emb = model.get_input_embeddings().weight
    emb[:, 0] = p["const"]
    attn = model.model.layers[0].self_attn
    if recipe["family"] == "qwen3":  # q/k are RMS-normalised per head: the norms' gain sets the sharpness
        attn.q_norm.weight.fill_(p["qk_norm_gain"])
        attn.k_norm.weight.fill_(p["qk_norm_gain"])
    else:  # scale q, k so each frequency adds score_per_freq to the attention logit
        x0 = (emb[:, 0] / emb.double().pow(2).mean(dim=1).sqrt()).mean().item()  # coord 0 after RMSNorm
        r = math.sqrt(p["score_per_freq"] * math.sqrt(dim)) / x0
        q, k = q * r, k * r
    attn.q_proj.weight[:dim] = 0.0
    attn.q_proj.weight[:dim, 0] = q.float()
    attn.k_proj.weight[:dim] = 0.0
    attn.k_proj.weight[:dim, 0] = k.float()


def _copy_batch(gen: torch.Generator, batch: int, task: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of a random segment (distinct ids) repeated to ``seq_len``, and a mask of the
    target positions the copy rule determines (from the second token of the first repetition on)."""
    seq_len, (lo, hi), (first, last) = task["seq_len"], task["segment_len"], task["token_ids"]
    ids = torch.empty(batch, seq_len, dtype=torch.long)
    mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    for b in range(batch):
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        segment = torch.randperm(last - first + 1, generator=gen)[:n] + first
        ids[b] = segment.repeat(seq_len // n + 1)[:seq_len]
        mask[b, n + 1 :] = True
    return ids, mask


def _train(model: torch.nn.Module, recipe: dict) -> list[float]:
    steps, warmup = recipe["steps"], recipe["warmup_steps"]
    decay_start = (1 - recipe["decay_fraction"]) * steps

    def lr_factor(step: int) -> float:
        factor = min(1.0, (step + 1) / warmup)
        if step >= decay_start:
            factor *= max(0.02, (steps - step) / (steps - decay_start))
        return factor

    adamw = recipe["adamw"]
    opt = torch.optim.AdamW(
        model.parameters(), lr=adamw["lr"], betas=tuple(adamw["betas"]), weight_decay=adamw["weight_decay"]
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    gen = torch.Generator().manual_seed(recipe["seed"] + 1)
    model.train()
    losses = []
    for _ in range(steps):
        ids, mask = _copy_batch(gen, recipe["batch"], recipe["task"])
        logits = model(input_ids=ids).logits[:, :-1]
        target, keep = ids[:, 1:], mask[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[keep], target[keep])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["grad_clip"])
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses


def heldout_prompts(
    n: int = _EVAL["prompts"], seed: int = _EVAL["seed"]
) -> list[tuple[list[int], list[int]]]:
    """``n`` (prompt, expected continuation) pairs: a segment plus half its repetition, then the
    rest of the repetition onwards. Drawn from their own seed, so not the training batches."""
    gen = torch.Generator().manual_seed(seed)
    task = _recipe(DEFAULT_FAMILY)["task"]
    (lo, hi), (first, last) = task["segment_len"], task["token_ids"]
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        segment = (torch.randperm(last - first + 1, generator=gen)[:length] + first).tolist()
        prompt = segment + segment[: length // 2]
        out.append((prompt, copy_continuation(prompt, _EVAL["new_tokens"])))
    return out


def copy_continuation(prompt: list[int] | tuple[int, ...], new_tokens: int) -> list[int]:
    """What copying continues ``prompt`` (a segment of distinct ids, then its start again) with."""
    period = list(prompt).index(prompt[0], 1)
    return [prompt[(len(prompt) + i) % period] for i in range(new_tokens)]


@torch.no_grad()
def _greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation (full recompute per step: simple, and small here) and each step's
    top-1 minus top-2 logit."""
    ids = list(prompt)
    margins = []
    for _ in range(new_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        top = torch.topk(logits, 2)
        margins.append((top.values[0] - top.values[1]).item())
        ids.append(int(top.indices[0]))
    return ids[len(prompt) :], margins


def _summary(margins: list[float]) -> dict:
    m = torch.tensor(margins, dtype=torch.float64)
    return {
        "min": round(m.min().item(), 4),
        "p5": round(torch.quantile(m, 0.05).item(), 4),
        "median": round(m.median().item(), 4),
    }


def margin_report(path: Path | str) -> dict:
    """Greedy decoding of the held-out copy prompts with the saved bf16 weights in fp32 math:
    the top-1 minus top-2 logit margins over all steps, and how many steps copied correctly.

    Why: token parity between implementations is only a real test where these margins are far
    above bf16 noise (~0.01-0.05 logits here). The CLI default prompts are measured too.
    """
    transformers = _hf()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32).eval()
        prompts = heldout_prompts()
        heldout = _measure(model, prompts)
        defaults = _measure(model, [(list(p), copy_continuation(p, _EVAL["new_tokens"])) for p in PROMPTS])
    finally:
        torch.set_num_threads(threads)
    return {
        "what": "top-1 minus top-2 logit over greedy steps; bf16 weights, fp32 math",
        "prompts": len(prompts),
        **heldout,
        "default_prompts": defaults,
    }


def _measure(model: torch.nn.Module, cases: list[tuple[list[int], list[int]]]) -> dict:
    margins, correct = [], 0
    for prompt, expected in cases:
        tokens, steps = _greedy(model, prompt, len(expected))
        margins += steps
        correct += sum(t == e for t, e in zip(tokens, expected, strict=True))
    return {"steps": len(margins), **_summary(margins), "copy_accuracy": round(correct / len(margins), 4)}
