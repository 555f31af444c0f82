# Sourced by the scripts that run on a lent device machine (gpu_checks.sh, device_regime.sh): its image has
# torch, transformers and accelerate but not the rest of the pinned set, which travels as wheels in .whl/
# (results/gpu/2026-11-27-h100/README.md lists them; name .whl in the device tool's carry). They are installed
# once per machine into $SITE (pip --target), the checkout goes on PYTHONPATH, and nothing is downloaded.
SITE=${SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false GIT_PYTHON_REFRESH=quiet
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 # nothing can be reached there
# JUPYTER_PATH: ipykernel's kernel 'python3' (the notebooks' -k python3), which jupyter_client starts with this
# Python (its argv[0] 'python' is replaced by sys.executable)
export PYTHONPATH=$SITE:$PWD PATH=$SITE/bin:$PATH JUPYTER_PATH=$SITE/share/jupyter

# install_wheels: the carried wheels into $SITE, once per machine (a warm machine keeps them); 1 on failure
install_wheels() {
    [[ -f $SITE/.installed ]] && return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl && touch "$SITE/.installed" && echo "wheels installed into $SITE" && return 0
    echo "wheel install failed: is .whl/ carried (the device tool's carry: [\".whl\"])?"
    return 1
}
