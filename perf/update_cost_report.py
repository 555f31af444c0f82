"""perf/update_cost.py's report: the columns of its three tables (the update cost per variant, the profile
of one micro-batch, the truncation bound) and their notes, written as ``<name>.json|md``,
``<name>_profile.*`` and ``<name>_truncation.*`` under --out (perf/_common.write_results)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from _common import fmt_seconds, markdown_table, write_results
from update_cost_truncation import ENTROPY_MODELS, SCHEDULE_POINTS
from update_cost_variants import KEEP, TOKEN_RATIO, G

UPDATE_COLUMNS = {
    "model": "{model}",
    "update": "{variant}",
    "micro-batch": "{micro_batch}",
    "rollouts (micro-batches x rows)": "{rollouts} ({micro_batches} x {micro_batch_rows})",
    "tokens (trained)": "{completion_tokens} ({trained_tokens})",
    "median time": lambda r: fmt_seconds(r["median_s"]),
    "time / GRPO": "{time_ratio_vs_grpo:.3f}",
    "peak memory": lambda r: "n/a" if r["peak_memory_mib"] is None else f"{r['peak_memory_mib']:.1f} MiB",
    "memory / GRPO": lambda r: (
        "n/a" if r["memory_ratio_vs_grpo"] is None else f"{r['memory_ratio_vs_grpo']:.3f}"
    ),
}
TRUNCATION_COLUMNS = {
    "token scores from": "{source}",
    "N": "{keep_per_prompt}",
    "K": "{token_keep_ratio:.0%}",
    "micro-batch rows": "{micro_batch_rows}",
    "mean completion tokens": "{mean_completion_tokens:.0f}",
    "tokens after last selected": "{token_fraction_after_last_selected:.2%}",
    "FLOPs after last selected (1.5B)": "{flop_fraction_after_last_selected:.2%}",
    "padded micro-batch columns": "{padded_micro_batch_fraction:.2%}",
}
PROFILE_COLUMNS = {
    "update": "{variant}",
    "micro-batch (rows x tokens)": "{rows} x {tokens}",
    "wall": lambda r: fmt_seconds(r["wall_s"]),
    "CPU time in ops": lambda r: fmt_seconds(r["cpu_op_s"]),
    "CUDA kernel time": lambda r: fmt_seconds(r["cuda_kernel_s"]) if r["kernels"] else "n/a",
    "GPU busy": lambda r: "n/a" if r["gpu_busy_fraction"] is None else f"{r['gpu_busy_fraction']:.0%}",
    "kernels (launches)": "{kernels} ({kernel_launches})",
    "launch CPU time": lambda r: fmt_seconds(r["launch_cpu_s"]),
    "trace": "{trace}",
}
PROFILE_OP_COLUMNS = {
    "update": "{variant}",
    "#": "{rank}",
    "operator": lambda r: r["op"][:70].replace("|", "/"),
    "calls": "{calls}",
    "self CUDA": lambda r: fmt_seconds(r["self_cuda_s"]),
    "self CPU": lambda r: fmt_seconds(r["self_cpu_s"]),
    "CPU total": lambda r: fmt_seconds(r["cpu_total_s"]),
}


def write_reports(
    args: Any,
    rows: list[dict],
    profiled: list[dict],
    truncation: list[dict],
    failed: list[str],
    geometries: list[tuple[int, int]],
) -> None:
    """The update-cost table, the profile (where ``profiled`` has rows) and the truncation table."""
    cuda = args.device == "cuda"
    device_text = "CUDA" if cuda else "CPU"
    device_name = f": {torch.cuda.get_device_name()}." if cuda else " (no GPU): CPU figures, not GPU figures."
    ratios = "; ".join(
        f"{label}, micro-batch {micro_batch}: "
        + ", ".join(
            f"{r['variant']} {r['time_ratio_vs_grpo']:.3f}"
            for r in rows
            if (r["model"], r["micro_batch"]) == (label, micro_batch) and r["variant"] != "grpo"
        )
        for label, micro_batch in dict.fromkeys((r["model"], r["micro_batch"]) for r in rows)
    )
    notes = [
        f"Measured on the {device_text}{device_name}",
        f"Run: perf/update_cost.py {' '.join(sys.argv[1:])}".rstrip(),
        "One update = the step's batch in micro-batches with gradient checkpointing, compute_loss + backward "
        "per micro-batch, gradient clipping, one AdamW step; median of the timed updates after a warm-up "
        "update. Column 'micro-batch': per_device_train_batch_size, the micro-batch of that row's figure. "
        "GRPO: the step's rows in micro-batches of that many rows. d3s and d3s (masked head): TRL's "
        "micro-batches (pack_micro_batches false), as many as GRPO's with N/G of the rows each. "
        "d3s (packed): pack_micro_batches true, the step's kept rows in ceil(rows / micro-batch) "
        "micro-batches (d3s/packing.py). Column 'rollouts': the micro-batches and rows the update ran.",
        "Peak memory: "
        + (
            "torch.cuda.max_memory_allocated during one update, above the allocation before it (weights, "
            "optimizer state)."
            if cuda
            else "growth of the resident set's high-water mark (VmHWM, /proc) during one update after a "
            "warm-up update, in a fresh process per variant; allocator reuse makes small values coarse."
        ),
        f"D3S / GRPO update time (kept rollouts {KEEP}/{G} = {KEEP / G:.2f}), per model and micro-batch: "
        f"{ratios}.",
    ]
    notes += failed + args.note
    settings = dict(
        num_generations=G,
        keep_per_prompt=KEEP,
        token_keep_ratio=TOKEN_RATIO,
        geometries=[f"{p}x{t}" for p, t in geometries],
        weights=args.weights,  # as run_geometry ran every model, the CPU ones too
        gradient_checkpointing=True,
    )
    title = f"Update cost: GRPO vs D3S ({device_text})"
    write_results(args.name, args, rows, markdown_table(rows, UPDATE_COLUMNS), notes, title=title, **settings)
    if profiled:
        summaries = [r for r in profiled if r["kind"] == "summary"]
        markdown = (
            markdown_table(summaries, PROFILE_COLUMNS)
            + "\n\nTop operators by self "
            + ("CUDA" if cuda else "CPU")
            + " time:\n\n"
            + markdown_table([r for r in profiled if r["kind"] == "op"], PROFILE_OP_COLUMNS)
        )
        first = summaries[0]
        notes = [
            f"Measured on the {device_text}{device_name}",
            "One micro-batch's compute_loss + backward (gradient checkpointing, autocast) of "
            f"{first['model']} at micro-batch {first['micro_batch']}, the update's last micro-batch, after a "
            "warm-up update, "
            "under torch.profiler (" + ("CPU and CUDA activities" if cuda else "CPU activity only") + "); "
            "the profiler's own overhead is in the wall time. 'CPU time in ops': self CPU time summed over "
            "operators (the host's work, the launch calls included); 'CUDA kernel time': the kernels' "
            "durations summed; 'GPU busy': that over the wall time (low: the micro-batch is bound by the "
            "host, a fixed cost a larger micro-batch shares). Traces: Chrome trace format (chrome://tracing, "
            "Perfetto).",
        ]
        title = f"Update cost: where one D3S micro-batch's time goes ({device_text})"
        write_results(f"{args.name}_profile", args, profiled, markdown, notes, title=title, **settings)
    modelled = [r for r in truncation if r["source"].startswith("MODEL")]
    bound = max(
        max(r["flop_fraction_after_last_selected"], r["padded_micro_batch_fraction"]) for r in modelled
    )
    decision = (
        "implement truncation: the saving is 10 % or more of the update"
        if bound >= 0.10
        else "do not implement truncation: the bound is under 10 % of the update"
    )
    notes = [
        "Saving bound = FLOPs of the forward/backward positions after each kept rollout's last selected "
        "token, over all forward/backward FLOPs (Qwen2.5-Math-1.5B per-token cost incl. causal attention), "
        "with packed rows. 'Padded micro-batch columns': the columns a padded micro-batch drops when cut at "
        "its latest last-selected token (this includes padding that trimming each micro-batch to its longest "
        "row would already drop). The optimizer step and fixed costs do not shrink, so the update-time "
        "saving is at most the larger of the two.",
        "Precondition: the selection must be known before the gradient pass (entropies from an earlier pass, "
        "e.g. vLLM's old-policy pass); computing them with an extra no-gradient forward costs about a "
        "quarter of a checkpointed forward + backward, more than any saving here.",
        "Entropy MODEL scenarios (not measurements): "
        + "; ".join(f"{k}: {v}" for k, v in ENTROPY_MODELS.items()),
        f"Largest modelled saving at the paper geometry: {bound:.2%}. Decision: {decision}.",
    ]
    title = "Token level: what stopping each kept rollout at its last selected token saves"
    markdown = markdown_table(truncation, TRUNCATION_COLUMNS)
    settings = {"schedule_points": SCHEDULE_POINTS} | settings
    write_results(f"{args.name}_truncation", args, truncation, markdown, notes, title=title, **settings)
