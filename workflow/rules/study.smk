# A study (docs/studies.md): a config with a `study` section targets results/<experiment>/studies/<name>/
# (report.md, claims.csv, controls.csv, measures.csv, figure.png|pdf) instead of the default's report. Its
# runs are the ordinary train and evaluate jobs of runs/<name>/seed<seed>, so studies of one experiment share
# every run they have in common; base-model variants, held-out longer problems and calibration runs are the
# rules here.
STUDY_REPORT = []
if STUDY is not None:
    STUDY_DIR = f"{RESULTS}/studies/{STUDY.name}"
    STUDY_REPORT = f"{STUDY_DIR}/report.md"
    STUDY_BASES = sorted({variant_of(name).base for name in STUDY.runs} - {None})
    # the evaluation settings of a model that has no KL to measure (a base model, held-out problems)
    EV_NO_KL = {key: value for key, value in EV_PARAMS.items() if key != "kl"}
    STUDY_RUNS = expand(f"{RESULTS}/runs/{{method}}/seed{{seed}}/train_summary.json", method=STUDY.runs, seed=SEEDS)
    STUDY_EVALS = expand(f"{RESULTS}/eval/{{method}}/seed{{seed}}/final/summary.json", method=STUDY.runs, seed=SEEDS)
    STUDY_EVALS += expand(
        f"{RESULTS}/eval/{{method}}/seed{{seed}}/step{{step}}/summary.json",
        method=STUDY.runs,
        seed=SEEDS,
        step=CKPT_STEPS,
    )
    STUDY_BASE_EVALS = [f"{RESULTS}/eval/base/summary.json"]
    STUDY_BASE_EVALS += [f"{RESULTS}/eval/bases/{base}/summary.json" for base in STUDY_BASES]
    STUDY_OOD = []
    if STUDY.ood is not None:
        OOD_DIR = f"{RESULTS}/eval_ood/{STUDY.ood.name}"
        STUDY_OOD = expand(f"{OOD_DIR}/{{method}}/seed{{seed}}/summary.json", method=STUDY.runs, seed=SEEDS)
        STUDY_OOD.append(f"{OOD_DIR}/base/summary.json")
    STUDY_CALIBRATION = []
    if STUDY.calibration is not None:
        STUDY_CALIBRATION = expand(
            f"{RESULTS}/runs/{{method}}/seed{{seed}}/train_summary.json",
            method=STUDY.calibration.runs,
            seed=STUDY.calibration.seeds,
        )

    rule base_model_variant:
        output:
            config=f"{RESULTS}/base_models/{{base}}/config.json",
            summary=f"{RESULTS}/base_models/{{base}}/base_summary.json",
        params:
            cfg=lambda wildcards: sft_params(wildcards.base)[0],
            task=lambda wildcards: sft_params(wildcards.base)[1],
        threads: config["base_model"]["threads"]
        resources:
            **config["base_model"].get("resources", {}),
        log:
            f"{RESULTS}/logs/base_model_{{base}}.log",
        conda:
            ENV
        script:
            "../scripts/base_model.py"

    rule evaluate_base_variant:
        input:
            f"{RESULTS}/base_models/{{base}}/config.json",
        output:
            summary=f"{RESULTS}/eval/bases/{{base}}/summary.json",
        params:
            model=lambda wildcards, input: str(Path(input[0]).parent),
            eval=EV_NO_KL,
            task=TASK,
            samples=EV["samples"],
            k=EV["k"],
            limit=EV.get("limit"),
        threads: EV["threads"]
        resources:
            **EV["resources"],
        log:
            f"{RESULTS}/logs/eval_base_{{base}}.log",
        conda:
            ENV
        script:
            "../scripts/evaluate.py"

    if STUDY.ood is not None:
        # The final models on problems unlike the training ones: the task's keys replaced by the study's.
        OOD_TASK = TASK | STUDY.ood.task
        OOD_EVAL = EV_NO_KL | ({"max_tokens": STUDY.ood.max_tokens} if STUDY.ood.max_tokens else {})
        if STUDY.ood.count:
            OOD_EVAL["synthetic"] = dict(EV.get("synthetic") or {}) | {"count": STUDY.ood.count}

        rule evaluate_ood:
            input:
                summary=f"{RESULTS}/runs/{{method}}/seed{{seed}}/train_summary.json",
            output:
                summary=f"{OOD_DIR}/{{method}}/seed{{seed}}/summary.json",
            params:
                model=lambda wildcards, input: str(Path(input.summary).parent / "final"),
                eval=OOD_EVAL,
                task=OOD_TASK,
                samples=EV["samples"],
                k=EV["k"],
                limit=None,
            threads: EV["threads"]
            resources:
                **EV["resources"],
            log:
                f"{RESULTS}/logs/eval_ood/{STUDY.ood.name}_{{method}}_seed{{seed}}.log",
            conda:
                ENV
            script:
                "../scripts/evaluate.py"

        rule evaluate_ood_base:
            input:
                BASE_MODEL_INPUT,
            output:
                summary=f"{OOD_DIR}/base/summary.json",
            params:
                model=model_param,
                eval=OOD_EVAL,
                task=OOD_TASK,
                samples=EV["samples"],
                k=EV["k"],
                limit=None,
            threads: EV["threads"]
            resources:
                **EV["resources"],
            log:
                f"{RESULTS}/logs/eval_ood/{STUDY.ood.name}_base.log",
            conda:
                ENV
            script:
                "../scripts/evaluate.py"

    rule study_report:
        input:
            runs=STUDY_RUNS,
            evals=STUDY_EVALS,
            base_evals=STUDY_BASE_EVALS,
            ood=STUDY_OOD,
            calibration=STUDY_CALIBRATION,
        output:
            report=STUDY_REPORT,
            claims=f"{STUDY_DIR}/claims.csv",
            controls=f"{STUDY_DIR}/controls.csv",
            measures=f"{STUDY_DIR}/measures.csv",
            figure=f"{STUDY_DIR}/figure.png",
            pdf=f"{STUDY_DIR}/figure.pdf",
        params:
            results=RESULTS,
            config=config,
        log:
            f"{RESULTS}/logs/study_{STUDY.name}.log",
        conda:
            ENV
        script:
            "../scripts/study_report.py"
