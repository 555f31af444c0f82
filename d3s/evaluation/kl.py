"""KL to the initial policy (k1, k3) on a fixed probe set, without gradient: one JSON per evaluated checkpoint
(docs/workflow/configuration.md, "eval.kl", says what is measured and why; the paper configs train with
beta = 0, so TRL logs no KL)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from d3s.evaluation.backends import eos_token_ids, load_model, problem_seed, truncate_at_eos
from d3s.provenance.manifest import now, write_json

if TYPE_CHECKING:  # torch is imported where it is used: the analysis reads KL_FILE without it
    import torch

KL_FILE = "kl.json"  # in the evaluated checkpoint's folder: eval/<method>/seed<seed>/{step<N>,final}/


@dataclass(frozen=True)
class KLProbeSettings:
    """The probe: the first ``prompts`` training prompts, ``samples`` completions each (``eval.kl``)."""

    prompts: int = 8
    samples: int = 4
    max_new_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 16
    dtype: str = "auto"

    def validate(self, prefix: str = "eval.kl.") -> None:
        """One-line errors naming the setting (``prefix`` + field name) before any model is loaded."""
        for name in ("prompts", "samples", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{prefix}{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError(
                f"{prefix}temperature must be > 0 (the KL is estimated on sampled completions), "
                f"got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{prefix}top_p must be in (0, 1], got {self.top_p}")


@contextlib.contextmanager
def _inference(model: Any) -> Iterator[None]:
    """No gradient, eval mode (no dropout); the model's training flag is restored after."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _padded(rows: Sequence[Sequence[int]], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows padded on ``side`` to the longest, and their attention mask."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    def pad(tensors: list[torch.Tensor], value: int) -> torch.Tensor:
        return pad_sequence(tensors, batch_first=True, padding_value=value, padding_side=side)

    ids = pad([torch.tensor(list(row), dtype=torch.long) for row in rows], pad_id)
    return ids, pad([torch.ones(len(row), dtype=torch.long) for row in rows], 0)


def probe_completions(
    policy: Any, tokenizer: Any, prompts: Sequence[str], settings: KLProbeSettings
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) of ``settings.samples`` samples per prompt, tokenised as TRL does, cut
    after the first EOS; seeded per batch in a forked RNG, so the caller's random state is untouched."""
    import torch
    from transformers import GenerationConfig

    if not prompts:
        raise ValueError("the KL probe needs at least one prompt")
    eos_ids = eos_token_ids(policy, tokenizer)
    if not eos_ids:
        raise ValueError("the model and tokenizer define no EOS token: completions could not end")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    # Every sampling setting explicit: a model's own generation defaults (top_k, repetition penalty) would
    # make the sampler differ from the distribution that is scored.
    generation = GenerationConfig(
        do_sample=True,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=0,
        repetition_penalty=1.0,
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=sorted(eos_ids),
        pad_token_id=pad_id,
    )
    rows = [list(tokenizer(prompt)["input_ids"]) for prompt in prompts for _ in range(settings.samples)]
    device = policy.device
    out: list[tuple[list[int], list[int]]] = []
    with _inference(policy):
        for chunk, start in enumerate(range(0, len(rows), settings.batch_size)):
            batch = rows[start : start + settings.batch_size]
            input_ids, attention = _padded(batch, pad_id, "left")  # generation continues from the right
            devices = [device.index or 0] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(problem_seed(settings.seed, "kl-probe", str(chunk)))
                sequences = policy.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention.to(device),
                    generation_config=generation,
                )
            new_tokens = sequences[:, input_ids.shape[1] :].tolist()
            out += [(ids, truncate_at_eos(row, eos_ids)) for ids, row in zip(batch, new_tokens, strict=True)]
    return out


def completion_logprobs(
    model: Any,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    temperature: float = 1.0,
    batch_size: int = 16,
    pad_id: int = 0,
) -> list[torch.Tensor]:
    """Per-token log-probs (float32, CPU) of each completion given its prompt under softmax(logits /
    temperature); padding is masked and positions count real tokens only: a row scores as alone."""
    import torch

    device = model.device
    out: list[torch.Tensor] = []
    with _inference(model):
        for start in range(0, len(sequences), batch_size):
            batch = sequences[start : start + batch_size]
            if not any(completion for _, completion in batch):
                out.extend(torch.zeros(0) for _ in batch)
                continue
            prompt_ids, prompt_mask = _padded([p for p, _ in batch], pad_id, "left")
            targets, completion_mask = _padded([c for _, c in batch], pad_id, "right")
            attention = torch.cat([prompt_mask, completion_mask], dim=1)
            logits = model(
                input_ids=torch.cat([prompt_ids, targets], dim=1).to(device),
                attention_mask=attention.to(device),
                position_ids=(attention.cumsum(-1) - 1).clamp(min=0).to(device),
                logits_to_keep=targets.shape[1] + 1,
            ).logits[:, :-1]
            logps = (logits.float() / temperature).log_softmax(-1)
            token_logps = logps.gather(-1, targets.to(device).unsqueeze(-1)).squeeze(-1).cpu()
            out += [token_logps[i, : len(completion)].clone() for i, (_, completion) in enumerate(batch)]
    return out


def per_token_kl(
    policy_logps: torch.Tensor, reference_logps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """k1 and k3 of every token (float64), from the log-probs of the sampled tokens under both models."""
    import torch

    log_ratio = reference_logps.double() - policy_logps.double()  # log pi_ref - log pi
    # exp(x) - x - 1 as expm1(x) - x: no cancellation near 0, and >= 0 after rounding (TRL's form is not)
    k3 = torch.expm1(log_ratio) - log_ratio
    return -log_ratio, k3


def kl_estimates(policy_logps: Sequence[torch.Tensor], reference_logps: Sequence[torch.Tensor]) -> dict:
    """Token means of k1 and k3 over every completion token, the sequence-level k1 mean and the counts."""
    import torch

    if len(policy_logps) != len(reference_logps) or not policy_logps:
        raise ValueError("kl_estimates needs the same, non-zero number of policy and reference completions")
    for logp, ref in zip(policy_logps, reference_logps, strict=True):
        if logp.shape != ref.shape:
            raise ValueError(f"policy and reference scored different lengths: {logp.shape} vs {ref.shape}")
    k1, k3 = per_token_kl(torch.cat(list(policy_logps)), torch.cat(list(reference_logps)))
    if not k1.numel():
        raise ValueError("the probe completions have no tokens")
    return {
        "k1": float(k1.mean()),
        "k3": float(k3.mean()),
        "k1_per_sequence": float(k1.sum()) / len(policy_logps),
        "tokens": k1.numel(),
        "sequences": len(policy_logps),
    }


def kl_to_reference(
    policy: Any, reference: Any, tokenizer: Any, prompts: Sequence[str], settings: KLProbeSettings
) -> dict:
    """KL(policy || reference) on the policy's own sampled completions of ``prompts``, without gradient: the
    estimates of :func:`kl_estimates`, ``mean_completion_tokens`` and ``truncated_fraction`` (no EOS)."""
    settings.validate(prefix="kl_to_reference: ")
    sequences = probe_completions(policy, tokenizer, prompts, settings)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    scoring = {"temperature": settings.temperature, "batch_size": settings.batch_size, "pad_id": pad_id}
    policy_logps = completion_logprobs(policy, sequences, **scoring)
    reference_logps = completion_logprobs(reference, sequences, **scoring)
    eos_ids = eos_token_ids(policy, tokenizer)  # not empty: probe_completions checked
    result = kl_estimates(policy_logps, reference_logps)
    result["mean_completion_tokens"] = result["tokens"] / result["sequences"]
    result["truncated_fraction"] = sum(not c or c[-1] not in eos_ids for _, c in sequences) / len(sequences)
    return result


def probe_prompts(train_config: dict, tokenizer: Any, count: int) -> list[str]:
    """The first ``count`` prompts of the run's training data, templated exactly as in training."""
    from d3s.runs.resolve import training_rows  # the training job's own prompt construction

    rows = training_rows(train_config, tokenizer)
    if len(rows) < count:
        raise ValueError(f"eval.kl.prompts is {count} but the training data has only {len(rows)} prompts")
    return [row["prompt"] for row in rows[:count]]


def measure_checkpoint_kl(
    checkpoint: str | os.PathLike[str],
    reference: str | os.PathLike[str],
    train_config: dict,
    out: str | os.PathLike[str],
    settings: KLProbeSettings,
    *,
    labels: dict | None = None,
    device: str | None = None,
) -> dict:
    """Measure the KL of ``checkpoint`` to ``reference`` on the probe of the run's ``train_config``
    (train.yaml) and write ``out`` (JSON); the models are freed before returning for the next backend."""
    import torch
    from transformers import AutoTokenizer

    settings.validate()
    started = time.perf_counter()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    prompts = probe_prompts(train_config, tokenizer, settings.prompts)
    policy = load_model(checkpoint, settings.dtype, device)
    ref_model = load_model(reference, settings.dtype, device)
    try:
        result = kl_to_reference(policy, ref_model, tokenizer, prompts, settings)
        dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
    finally:
        del policy, ref_model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    record = (labels or {}) | {
        "model": str(checkpoint),
        "reference": str(reference),
        "settings": asdict(settings),
        "probe_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "device": device,
        "dtype": dtype,
        "seconds": round(time.perf_counter() - started, 3),
        "written": now(),
        **result,
    }
    write_json(out, record, sort_keys=True)  # never half a file
    return record
