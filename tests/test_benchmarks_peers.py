"""benchmarks/peers.py against real servers on the tiny model: one it starts itself, one given by URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from server_fixtures import one_torch_thread, running_server

from benchmarks.llama_peer import gguf_as, source_gguf
from benchmarks.peer_isa import SITE_DIR, forced_env
from benchmarks.peer_runs import check_exact, median_of_rounds
from benchmarks.peer_servers import LLAMA_DEFAULT_ARGS, PeerPaths, ServerSpec, command, parse_serve
from benchmarks.peers import Workload, cpu_info, pick_reference, run_peers
from serving.loadgen.run import run_serving_benchmark


def test_specs_workload_and_cpu_flags(tmp_path):
    assert parse_serve("quantgate") == ServerSpec("quantgate", [])
    assert parse_serve("quantgate:--dtype bfloat16 --threads 1").args == ["--dtype", "bfloat16", "--threads", "1"]
    assert parse_serve("vllm:--dtype float32").label == "vLLM CPU --dtype float32"
    assert parse_serve("url=http://127.0.0.1:9/").url == "http://127.0.0.1:9"
    with pytest.raises(ValueError, match="url=URL"):
        parse_serve("tgi")
    work = Workload(num_requests=20, prompt_tokens=(3, 9), output_tokens=(2, 5), token_ids=(1000, 1100), seed=4)
    reqs = work.requests()
    assert reqs == Workload(20, (3, 9), (2, 5), (1000, 1100), 4).requests()  # same seed, same workload
    assert all(3 <= len(p) <= 9 and all(1000 <= t <= 1100 for t in p) and 2 <= n <= 5 for p, n in reqs)
    fake = tmp_path / "cpuinfo"
    fake.write_text("model name\t: Some CPU\nflags\t\t: fpu avx2 avx512f amx_bf16 avx512_bf16\n\n"
                    "model name\t: Some CPU\nflags\t\t: fpu\n")
    info = cpu_info(str(fake))
    assert info["model_name"] == "Some CPU" and info["flags"] == ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    ok = {"index": 0, "ok": True, "error": None, "output_tokens": 4, "prompt_tokens": 3}
    assert check_exact([([1, 2, 3], 4)], [ok]) == []
    assert "forced 5" in check_exact([([1, 2, 3], 5)], [ok])[0]
    rows = [{"label": "a", "kind": "quantgate"}, {"label": "b", "kind": "vllm"}]
    assert pick_reference(rows, None) == 1 and pick_reference(rows, "1") == 0 and pick_reference(rows, "a") == 0


def test_weights_words_and_the_llama_cpp_command(tmp_path):
    variant = parse_serve("quantgate:int4wo --threads 1")
    assert (variant.weights, variant.args, variant.label) == ("int4wo", ["--threads", "1"],
                                                              "quantgate serve int4wo --threads 1")
    assert parse_serve("llama") == ServerSpec("llama", [], weights="F16")
    q8 = parse_serve("llama:q8_0 --parallel 1")
    assert (q8.weights, q8.args, q8.label) == ("Q8_0", ["--parallel", "1"], "llama.cpp Q8_0 --parallel 1")
    with pytest.raises(ValueError, match="Q3_X"):
        parse_serve("llama:Q3_X")
    with pytest.raises(ValueError, match="vLLM serves the model itself"):
        parse_serve("vllm:int4wo")
    peers = PeerPaths(tmp_path / "vllm", tmp_path / "llama.cpp")
    with pytest.raises(ValueError, match="peers_setup_llama.sh"):
        command(q8, 8001, tmp_path / "m.gguf", "smol", peers)
    (tmp_path / "llama.cpp" / "bin").mkdir(parents=True)
    (tmp_path / "llama.cpp" / "bin" / "llama-server").write_text("")
    cmd = command(q8, 8001, tmp_path / "m.gguf", "smol", peers)
    assert cmd[0] == str(tmp_path / "llama.cpp" / "bin" / "llama-server")
    assert cmd[1:9] == ["--model", str(tmp_path / "m.gguf"), "--alias", "smol", "--host", "127.0.0.1", "--port", "8001"]
    threads = ["--threads", str(len(os.sched_getaffinity(0)))]  # the CPUs this process may use
    assert cmd[9:] == [*LLAMA_DEFAULT_ARGS, *threads, "--parallel", "1"]  # the spec's own args last: they win
    shipped = source_gguf("smollm2-135m")  # the package's Q4_1 file is served as it is
    assert shipped.name.endswith(".Q4_1.gguf") and gguf_as("smollm2-135m", "Q4_1", peers.llama_dir) == shipped
    with pytest.raises(ValueError, match="llama-quantize"):  # F16 needs llama-quantize, not built here
        gguf_as("smollm2-135m", "F16", peers.llama_dir)
    assert not list(peers.llama_dir.glob("models/*"))  # nothing half-made
    with pytest.raises(ValueError, match="GGUF"):
        source_gguf(str(tmp_path))
    with pytest.raises(ValueError, match="unknown quantization method 'int3wo'"):
        run_peers([parse_serve("quantgate:int3wo")], out_dir=tmp_path)
    with pytest.raises(ValueError, match="--concurrency must be at least 1"):
        run_peers([parse_serve("quantgate")], work=Workload(concurrency=0), out_dir=tmp_path)
    assert not (tmp_path / "peers.json").exists()  # nothing was started or written


def test_forcing_every_server_onto_avx2(tmp_path):
    base = {"PATH": "/bin", "PYTHONPATH": "/x"}
    assert forced_env(base, "vllm", None) is base
    torch_env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    ours = forced_env(base, "quantgate", "avx2")
    assert ours == {**base, **torch_env, "QUANTGATE_ISA": "avx2"}
    assert forced_env(base, "llama", "avx2") == {**base, **torch_env}  # llama.cpp: as it was compiled
    vllm = forced_env(base, "vllm", "avx2")
    assert vllm["PYTHONPATH"] == f"{SITE_DIR}{os.pathsep}/x" and "QUANTGATE_ISA" not in vllm
    probe = "import torch; print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported(), " \
            "torch.cpu._is_amx_tile_supported())"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", probe], env=forced_env(env, "vllm", "avx2"), capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]  # what vLLM asks before it loads _C_AVX512
    with pytest.raises(ValueError, match="forced onto avx2"):
        run_peers([parse_serve("quantgate")], out_dir=tmp_path, isa="avx512")
    assert not (tmp_path / "peers.json").exists()


def test_token_id_prompts_through_the_shared_client(tiny_model_dir):
    with one_torch_thread(), running_server(tiny_model_dir) as server:
        report = run_serving_benchmark(server.url, "tiny", requests=[([1000, 1001, 1002], 3), ([1003] * 5, 2)],
                                       details=True)
        assert report["completed"] == 2 and report["total_output_tokens"] == 5
        assert [r["prompt_tokens"] for r in report["requests"]] == [3, 5]
        with pytest.raises(ValueError, match="min_tokens"):  # ours refuses fields it does not know
            run_serving_benchmark(server.url, "tiny", requests=[([1000], 2)], min_tokens=True)


def test_peers_against_a_started_and_a_given_server(tiny_model_dir, tmp_path):
    work = Workload(num_requests=6, prompt_tokens=(4, 24), output_tokens=(2, 6), seed=1)
    expected = sum(n for _, n in work.requests())
    with one_torch_thread(), running_server(tiny_model_dir) as given:
        report = run_peers([parse_serve(f"url={given.url}"), parse_serve("quantgate:--threads 1 --num-kv-blocks 64")],
                           model=str(tiny_model_dir), served_name="tiny", work=work, reference="1",
                           out_dir=tmp_path, startup_timeout_s=240, timeout_s=120)
    saved = json.loads((tmp_path / "peers.json").read_text())
    assert saved["reference"] == given.url and saved["cpu"]["model_name"]
    for row in saved["rows"]:
        assert "error" not in row, row.get("traceback")
        assert row["exact"] and row["problems"] == [] and row["min_tokens"] is False
        assert row["completed"] == 6 and row["failed"] == 0
        assert row["total_output_tokens"] == row["expected_output_tokens"] == expected
        assert set(row["ratios"]) == {"output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms"}
        assert all(v is not None and v > 0 for v in row["ratios"].values())
    assert saved["rows"][0]["ratios"]["output_tok_s"] == 1.0
    started = saved["rows"][1]
    assert started["startup_s"] > 0 and started["label"].startswith("quantgate serve --threads 1")
    with pytest.raises(ProcessLookupError):  # the started server's whole process group is gone
        os.killpg(started["pid"], 0)
    assert (tmp_path / "peers.png").is_file() and "| quantgate serve" in (tmp_path / "peers.md").read_text()
    assert report["json"] == str(tmp_path / "peers.json")


def test_one_request_at_a_time(tiny_model_dir, tmp_path):
    work = Workload(num_requests=4, prompt_tokens=(4, 8), output_tokens=(6, 6), seed=2, concurrency=1)
    with one_torch_thread(), running_server(tiny_model_dir) as given:
        report = run_peers([parse_serve(f"url={given.url}")], model=str(tiny_model_dir), served_name="tiny",
                           work=work, out_dir=tmp_path, timeout_s=120, plots=False)
    row = report["rows"][0]
    assert "error" not in row, row.get("traceback")
    assert row["exact"] and row["total_output_tokens"] == 24
    sent = sorted(row["serving"]["requests"], key=lambda r: r["send_time"])
    for before, after in zip(sent[:-1], sent[1:], strict=True):  # each request starts after the one before has finished
        assert after["send_time"] >= before["send_time"] + before["e2e"] - 1e-3
    assert row["serving"]["config"]["concurrency"] == 1
    assert "4 requests 1 at a time" in (tmp_path / "peers.md").read_text()



def test_median_of_rounds():
    def round_(tok_s, ttft, exact=True):
        return {"output_tok_s": tok_s, "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft, "tpot_p50_ms": 10.0,
                "duration_s": 1.0, "exact": exact, "problems": [] if exact else ["request 3: 4 output tokens"],
                "min_tokens": False, "load_avg_1m": {"before": 0.5, "after": 0.7}, "completed": 4, "failed": 0,
                "total_output_tokens": 20, "total_input_tokens": 30, "expected_output_tokens": 20}

    row = median_of_rounds([round_(90.0, 100.0), round_(60.0, 300.0), round_(80.0, 200.0, exact=False)])
    assert (row["output_tok_s"], row["ttft_p50_ms"], row["ttft_p99_ms"]) == (80.0, 200.0, 400.0)
    assert row["exact"] is False and row["problems"] == ["request 3: 4 output tokens"]
    assert row["total_output_tokens"] == 60 and row["completed"] == 12


def test_interleaved_rounds(tiny_model_dir, tmp_path):
    work = Workload(num_requests=3, prompt_tokens=(4, 8), output_tokens=(3, 5), seed=3)
    expected = sum(n for w in (work, replace(work, seed=work.seed + 1)) for _, n in w.requests())
    with one_torch_thread(), running_server(tiny_model_dir) as given:
        report = run_peers([parse_serve("quantgate:--threads 1 --num-kv-blocks 64"), parse_serve(f"url={given.url}")],
                           model=str(tiny_model_dir), served_name="tiny", work=work, reference="2", rounds=2,
                           out_dir=tmp_path, startup_timeout_s=240, timeout_s=120, plots=False)
    assert report["rounds"] == 2
    for row in report["rows"]:
        assert "error" not in row, row.get("traceback")
        assert len(row["rounds"]) == 2 and all(r["exact"] for r in row["rounds"])
        assert row["exact"] and row["total_output_tokens"] == expected
        sent = [[r["prompt_tokens"] for r in one["serving"]["requests"]] for one in row["rounds"]]
        assert sent == [[len(p) for p, _ in w.requests()] for w in (work, replace(work, seed=work.seed + 1))]
        assert sent[0] != sent[1]  # fresh prompts each round: the prefix cache cannot answer round 2
        assert row["output_tok_s"] == pytest.approx((row["rounds"][0]["output_tok_s"] + row["rounds"][1]["output_tok_s"]) / 2)
    with pytest.raises(ProcessLookupError):  # the started server is stopped after the last round
        os.killpg(report["rows"][0]["pid"], 0)
    with pytest.raises(ValueError, match="--rounds must be at least 1"):
        run_peers([parse_serve("quantgate")], rounds=0, out_dir=tmp_path)
