"""Shared fixtures: isolated state per session, the tiny random Llama, the real default model."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Isolate every piece of long-lived state before anything imports MLflow/Prefect/transformers.
_SESSION_HOME = Path(tempfile.mkdtemp(prefix="quantgate-test-home-"))
atexit.register(shutil.rmtree, _SESSION_HOME, ignore_errors=True)
os.environ["QUANTGATE_HOME"] = str(_SESSION_HOME)
# One kernel build per session, also for tests that give a subprocess its own QUANTGATE_HOME, and for the
# workers of `pytest -n` (make test): a worker keeps the directory its controller set (builds are locked).
_KERNELS = os.environ.get("QUANTGATE_KERNEL_DIR") if os.environ.get("PYTEST_XDIST_WORKER") else None
os.environ["QUANTGATE_KERNEL_DIR"] = _KERNELS or str(_SESSION_HOME / "kernels")
os.environ["PREFECT_HOME"] = str(_SESSION_HOME / "prefect")
# Set here, not left to prepare()'s default: a `pytest -n` worker inherits its controller's, and two workers
# sharing one result storage took each other's cached quantize results (the same tiny model's cache key).
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(_SESSION_HOME / "flows" / "results")
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_SESSION_HOME / 'mlflow.db'}"
os.environ["HF_HOME"] = str(_SESSION_HOME / "hf")
# Tests start servers in subprocesses beside the test process: OpenMP threads that spin while waiting
# turn that oversubscription of 2 cores into 10-100x slowdowns; passive waiting keeps them fair.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Engines default to bf16 on CPUs with native bf16; tests compare token by token with HF in fp32, so
# they pin fp32 (test_device.py checks the automatic choice itself).
os.environ["QUANTGATE_DTYPE"] = "float32"
# serving/kernels/cuda's Triton kernels run on CPU tensors in Triton's interpreter, which triton reads when a kernel
# is defined: set for the whole session, before any test module imports serving.kernels.cuda.
if os.environ.get("QUANTGATE_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

# The tests are an entry point like the CLI: quantgate's offline/quiet defaults and Prefect's environment
# (flows.runtime.prepare), set before anything imports Prefect; importing flows/ sets nothing.
from flows.runtime import prepare  # noqa: E402

prepare()


@pytest.fixture
def store(tmp_path, monkeypatch) -> str:
    """An MLflow sqlite store and a QUANTGATE_HOME of this test's own (files may define their own `store`)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path / "home"))
    return uri


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted once per test session."""
    from quantgate.models import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir: Path) -> Path:
    """A randomly initialised 2-layer Llama (GQA) with the default model's tokenizer; seconds to build."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = _SESSION_HOME / "tiny-llama"
    if (path / "config.json").is_file():
        return path
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
