"""`quantgate bench release-memory` watches a release's process tree from /proc/<pid>/status: a child counts its
own anonymous memory, a fork that has not exec'd counts none (its pages are its parent's)."""

import subprocess
import sys
import textwrap

from benchmarks.release_memory import _tree_memory

MB = 1 << 20

PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    held = bytearray(300 * (1 << 20))  # touched: resident anonymous memory
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time; b = bytearray(200 * (1 << 20)); print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    if os.fork() == 0:  # a fork that never execs: the parent's pages, shared
        time.sleep(60)
        os._exit(0)
    print("ready", flush=True)
    time.sleep(60)
""")


def test_the_tree_counts_each_process_once_and_a_fork_as_its_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        anon, rss, processes = _tree_memory(parent.pid)
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(parent.pid)], check=False)
        parent.kill()
        parent.wait()
    own = {pid: a for pid, _, a in processes}
    assert len(processes) == 3  # the parent, its exec'd child, its fork
    assert 300 * MB <= own[parent.pid] < 400 * MB
    exec_child = [a for pid, command, a in processes if "200 * (1 << 20)" in command]
    assert len(exec_child) == 1 and 200 * MB <= exec_child[0] < 300 * MB
    assert sorted(own.values())[0] == 0  # the fork: counted with its parent
    assert 500 * MB <= anon < 700 * MB  # not 800+: the fork's shared 300 MB once
    assert rss >= anon
