# Stage 5: tables/claims.csv (every claim: paired interval, verdict) and report.md (d3s.analysis.report);
# `snakemake --report report.html` builds Snakemake's HTML report as well.


report: "../report/workflow.rst"


rule report:
    input:
        notebooks=[f"{RESULTS}/notebooks/{notebook}.ipynb" for notebook in NOTEBOOKS],  # and their tables
        provenance=PROVENANCE,
        base=f"{RESULTS}/base_model/base_summary.json" if TINY_BASE else [],
    output:
        report_md=f"{RESULTS}/report.md",
        claims=report(
            f"{RESULTS}/tables/claims.csv", caption="../report/tables/claims.rst", category="Tables"
        ),
        claims_sidecar=f"{RESULTS}/tables/claims.provenance.json",
    params:
        results=lambda wildcards, output: str(Path(output.report_md).parent),
        config=config,
    log:
        f"{RESULTS}/logs/report.log",
    conda:
        ENV
    script:
        "../scripts/write_report.py"
