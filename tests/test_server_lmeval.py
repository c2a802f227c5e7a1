"""lm-eval's `local-completions` against the real server scores exactly what the in-process engine scores."""

from __future__ import annotations

import json

import pytest
from server_fixtures import one_torch_thread, running_server, tiny_engine

MC_DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five", " six"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": [" green", " blue", " red"], "answer": 1},
    {"question": "Water freezes at", "choices": [" 100 degrees", " 0 degrees", " 50 degrees"], "answer": 1},
    {"question": "", "choices": ["Cats", "Dogs"], "answer": 0},  # empty context: lm-eval's prefix token
]
GEN_DOCS = [
    {"question": "Q: What is the capital of Italy?\nA:", "answer": "Rome"},
    {"question": "Q: Name a color.\nA:", "answer": "blue"},
    {"question": "Once upon a time", "answer": "there"},
]

TASKS = {
    "qg_server_mc": {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                     "metric_list": [{"metric": "acc"}]},
    "qg_server_gen": {"output_type": "generate_until", "doc_to_target": "{{answer}}",
                      "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 12, "do_sample": False},
                      "metric_list": [{"metric": "exact_match"}]},
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    import yaml

    root = tmp_path_factory.mktemp("lmeval-tasks")
    for name, docs in (("qg_server_mc", MC_DOCS), ("qg_server_gen", GEN_DOCS)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                  "test_split": "test", "doc_to_text": "{{question}}", **TASKS[name]}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(config))
    return root


def _evaluate(lm, task_dir) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(task_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=list(TASKS), task_manager=tm, log_samples=True,
                                   bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def _responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_local_completions_equal_in_process_engine(tiny_model_dir, task_dir):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from evals.lm import EngineLM

    with one_torch_thread():
        local = _evaluate(EngineLM(tiny_engine(tiny_model_dir), model_name="tiny", show_progress=False), task_dir)
        with running_server(tiny_model_dir) as srv:
            http = LocalCompletionsAPI(base_url=f"{srv.url}/v1/completions", model="tiny",
                                       tokenizer_backend="remote", tokenized_requests=True, num_concurrent=4,
                                       max_length=1025, max_retries=1, timeout=60)
            assert http.tokenizer_backend == "remote"  # it used our /tokenizer_info, /tokenize, /detokenize
            remote = _evaluate(http, task_dir)

    mc_local, mc_remote = _responses(local, "qg_server_mc"), _responses(remote, "qg_server_mc")
    assert len(mc_remote) == len(MC_DOCS)
    for doc_local, doc_remote in zip(mc_local, mc_remote, strict=True):
        assert len(doc_remote) == len(doc_local)
        for [(ll_local, greedy_local)], [(ll_remote, greedy_remote)] in zip(doc_local, doc_remote, strict=True):
            assert ll_remote == pytest.approx(ll_local, abs=1e-4)
            assert greedy_remote == greedy_local
            assert ll_remote < 0
    gen_local, gen_remote = _responses(local, "qg_server_gen"), _responses(remote, "qg_server_gen")
    assert gen_remote == gen_local
    assert any(r[0] for r in gen_remote), "the generations are not all empty"
    for task in TASKS:  # the aggregate scores too
        scores = {k: v for k, v in remote["results"][task].items() if "," in k and "stderr" not in k}
        assert scores and scores == {k: local["results"][task][k] for k in scores}, task
