# Stage 1: the shared base model (tiny: built in code, SFT-warm-started) and its evaluation (step 0).


rule base_model:
    output:
        config=f"{RESULTS}/base_model/config.json",
        summary=f"{RESULTS}/base_model/base_summary.json",
    params:
        cfg=sft_params(None)[0],
        task=sft_params(None)[1],
    threads: config["base_model"]["threads"]
    resources:
        **config["base_model"].get("resources", {}),
    log:
        f"{RESULTS}/logs/base_model.log",
    conda:
        ENV
    script:
        "../scripts/base_model.py"


rule evaluate_base:
    input:
        BASE_MODEL_INPUT,
    output:
        summary=f"{RESULTS}/eval/base/summary.json",
    params:
        model=model_param,
        eval=config["eval"],
        task=TASK,
        samples=config["eval"]["samples"],
        k=config["eval"]["k"],
        limit=config["eval"].get("limit"),
    threads: config["eval"]["threads"]
    resources:
        **config["eval"]["resources"],
    log:
        f"{RESULTS}/logs/eval_base.log",
    conda:
        ENV
    script:
        "../scripts/evaluate.py"
