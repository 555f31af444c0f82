"""perf/update_cost.py --profile: where one micro-batch's time goes. torch.profiler over one D3S
micro-batch's forward + backward (TRL's micro-batches and packed), after a warm-up update: a summary (wall,
CPU time in operators, CUDA kernel time, kernel launches), the top operators and a Chrome trace each."""

from __future__ import annotations

import gc
import re
import time
from pathlib import Path
from typing import Any

import torch
from update_cost_variants import kept_rows, make_trainer, micro_batches, update

PROFILED = ("d3s", "d3s (packed)")  # D3S in TRL's micro-batches (N/G of the rows each), and packed
LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
TOP_OPS = 15


def _self_device_us(event: Any) -> float:
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))


def profile_micro_batch(trainer: Any, batch: dict, trace: Path, cuda: bool) -> tuple[dict, list[dict]]:
    """One micro-batch's forward + backward (the update's last one, which packing fills) under torch.profiler,
    after a warm-up update; its Chrome trace written to ``trace``. Returns a summary (wall, CPU time in
    operators, CUDA kernel time, kernel launches) and the top operators by self CUDA time (CPU: self CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from d3s.packing import rows_of

    update(trainer, batch)  # warm-up: the token mask, the allocator's pool, the kernels' first calls
    part = micro_batches(trainer, batch)[-1]
    trainer.optimizer.zero_grad(set_to_none=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        with trainer.compute_loss_context_manager(), trainer.accelerator.autocast():
            loss = trainer.compute_loss(trainer.model, part)
        trainer.accelerator.backward(loss)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    trainer._close_step_metrics()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    averages = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    launches = [e for e in averages if e.key in LAUNCH_CALLS]
    cpu_us = sum(e.self_cpu_time_total for e in averages)
    kernel_us = sum(e.duration for e in kernels) if kernels else 0.0
    summary = {
        "rows": rows_of(part),
        "tokens": int(part["prompt_mask"].shape[1] + part["completion_mask"].shape[1]),
        "wall_s": wall,
        "cpu_op_s": cpu_us / 1e6,
        "cuda_kernel_s": kernel_us / 1e6,
        "gpu_busy_fraction": kernel_us / 1e6 / wall if cuda else None,
        "kernels": len(kernels),
        "kernel_launches": sum(e.count for e in launches),
        "launch_cpu_s": sum(e.self_cpu_time_total for e in launches) / 1e6,
        "mean_kernel_us": kernel_us / len(kernels) if kernels else None,
        "trace": trace.name,
    }
    by = _self_device_us if cuda else (lambda e: float(e.self_cpu_time_total))
    top = [
        {
            "op": e.key,
            "calls": e.count,
            "self_cuda_s": _self_device_us(e) / 1e6,
            "self_cpu_s": e.self_cpu_time_total / 1e6,
            "cpu_total_s": e.cpu_time_total / 1e6,
        }
        for e in sorted(averages, key=by, reverse=True)[:TOP_OPS]
    ]
    return summary, top


def profile_geometry(
    label: str, model: Path | Any, work: Path, full: dict, args: Any, device: str, micro_batch: int
) -> list[dict]:
    """``profile_micro_batch`` for each variant of ``PROFILED`` (a fresh trainer each, freed before the next);
    the traces go to ``args.out``. One summary row per variant, then its top operators."""
    cuda = device == "cuda"
    rows, width = int(full["advantages"].shape[0]), int(full["completion_mask"].shape[1])
    kept = kept_rows(full)
    out: list[dict] = []
    for name in PROFILED:
        trainer = make_trainer(
            name,
            model,
            work / f"profile-mb{micro_batch}",
            micro_batch,
            rows,
            device,
            args.weights,
            True,
            width,
        )
        trace = args.out / f"update_cost_profile_{re.sub(r'[^a-z0-9]+', '_', name).strip('_')}.json.gz"
        summary, top = profile_micro_batch(trainer, kept, trace, cuda)
        common = {"model": label, "variant": name, "device": device, "micro_batch": micro_batch}
        out.append(common | {"kind": "summary"} | summary)
        out += [common | {"kind": "op", "rank": i + 1} | op for i, op in enumerate(top)]
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out
