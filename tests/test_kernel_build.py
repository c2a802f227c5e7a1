"""serving/kernels/cpu/build.py: a process killed while it built or loaded a kernel (a server stopped, a Ray
replica scaled down) leaves torch's `lock` file in the build folder; the next process builds and loads
anyway instead of waiting for it forever (a spawned parallel rank once hung there for 10 minutes)."""

from __future__ import annotations

import threading

import torch

from serving.kernels.cpu import build

SOURCE = """
#include <torch/library.h>
int64_t answer() { return 42; }
TORCH_LIBRARY(quantgate_build_test, m) { m.def("answer() -> int", &answer); }
"""


def test_a_dead_builders_lock_file_does_not_stop_the_next_load(tmp_path):
    source = tmp_path / "answer.cpp"
    source.write_text(SOURCE)
    flags = ["-O1"]
    (build.build_dir(source, flags, "build_test") / "lock").write_text("")  # what the killed process left
    loaded: list[bool] = []
    thread = threading.Thread(target=lambda: loaded.append(build.load(source, flags, name="build_test")),
                              daemon=True)
    thread.start()
    thread.join(timeout=300)
    assert loaded == [True], "the load waited on a dead process's lock file"
    assert torch.ops.quantgate_build_test.answer() == 42
