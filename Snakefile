# d3s-repro: the reproduction workflow. `snakemake --cores 2` runs the tiny offline default
# (config/config.yaml); `snakemake --cores N --configfile config/paper/<name>.yaml` a paper configuration.
# Stages, one file each under workflow/rules/: input checks, base model, train, evaluate, analyse, report;
# `--configfile config/studies/<name>.yaml` runs a study instead (study.smk, docs/studies.md).
from snakemake.utils import min_version

min_version("9.0")


# The default, config/config.yaml, unless a --configfile replaces it (it is not merged into it); --config values
# apply on top of either, as Snakemake documents (common.smk types them).
if not workflow.overwrite_configfiles:


    configfile: "config/config.yaml"


include: "workflow/rules/common.smk"  # validates config against config/schema.yaml first


wildcard_constraints:
    method="[a-z0-9_]+",
    base="[a-z0-9_]+",
    seed=r"\d+",
    step=r"\d+",


include: "workflow/rules/checks.smk"
include: "workflow/rules/base_model.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/analyse.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/study.smk"  # rules of a config's study section (docs/studies.md), if it has one


rule all:
    default_target: True
    input:
        report_md=f"{RESULTS}/report.md" if STUDY is None else STUDY_REPORT,
