"""Snakemake script of rules evaluate_run (a run's checkpoints and final model, in training order),
evaluate_checkpoint, evaluate_final and the base models' evaluations (one model each): a thin caller of
d3s.orchestration.evaluation_job.run_evaluation_job (docs/workflow.md, "Evaluation resumes")."""

from pathlib import Path

from d3s.orchestration.evaluation_job import EvalPoint, TrainedRun, run_evaluation_job

smk = snakemake  # noqa: F821 - injected by Snakemake
outs = [Path(path).parent for path in smk.output]
if smk.rule == "evaluate_run":  # the run's points in training order, outputs in the same order
    models = [str(Path(smk.params.run) / point["model"]) for point in smk.params.points]
    settings = list(smk.params.points)
else:
    models = [str(smk.params.model)]
    settings = [{"samples": smk.params.samples, "k": smk.params.k, "limit": smk.params.limit}]
points = [
    EvalPoint(model, out, int(point["samples"]), tuple(point["k"]), int(point["limit"] or 0) or None)
    for model, out, point in zip(models, outs, settings, strict=True)
]
run = None
if hasattr(smk.input, "summary"):  # a run's models (its train_summary.json): not a base model
    train_config = Path(smk.input.train_config) if hasattr(smk.input, "train_config") else None
    reference = str(smk.params.reference) if hasattr(smk.params, "reference") else None
    folder, wildcards = Path(smk.input.summary).parent, smk.wildcards
    run = TrainedRun(folder, wildcards.method, int(wildcards.seed), reference, train_config)
run_evaluation_job(
    points,
    smk.params.eval,
    smk.params.task,
    run=run,
    gpus=int(getattr(smk.resources, "gpu", 0) or 0),  # what Snakemake granted
    threads=int(smk.threads),
    label=f"{smk.rule} {dict(smk.wildcards)}",
    log=smk.log[0],
)
