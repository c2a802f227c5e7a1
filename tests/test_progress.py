"""Stage progress on a stream that is not a terminal (a pipe: `make demo 2>&1 | tee`, CI logs): one plain
line per stage start and end, with elapsed seconds and failures, there as soon as it happens."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

from flows.progress import note, stage, terminal_progress


def _read_available(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


@pytest.fixture
def pipe():
    """A block-buffered text stream on a pipe, and a non-blocking reader of what reached the pipe."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    stream = os.fdopen(w, "w", buffering=8192)
    yield stream, lambda: _read_available(r)
    stream.close()
    os.close(r)


def test_a_pipe_gets_one_flushed_line_per_stage_start_and_end(pipe):
    stream, read = pipe
    seen_while_running = []
    with terminal_progress(stream=stream):
        with stage("quantize m -> int8", total=3) as advance:
            seen_while_running.append(read())
            advance(1)
            time.sleep(0.2)
            advance(2)
        note("MLflow release run abc")
        with pytest.raises(ValueError, match="no such method"):
            with stage("quantize m -> fp3"):
                raise ValueError("no such method: fp3\nsecond line of detail")
        with pytest.raises(KeyboardInterrupt):
            with stage("measure m"):
                raise KeyboardInterrupt
    assert seen_while_running == ["[quantgate] quantize m -> int8 ...\n"]  # written and flushed at start
    lines = read().splitlines()
    assert len(lines) == 6, lines
    done = re.fullmatch(r"\[quantgate\] quantize m -> int8 done in (\d+\.\d) s", lines[0])
    assert done is not None, lines[0]
    assert 0.2 <= float(done.group(1)) < 5.0
    assert lines[1] == "[quantgate] MLflow release run abc"
    assert lines[2] == "[quantgate] quantize m -> fp3 ..."
    assert re.fullmatch(r"\[quantgate\] quantize m -> fp3 FAILED after \d+\.\d s: ValueError: no such method: fp3",
                        lines[3]), lines[3]
    assert lines[4] == "[quantgate] measure m ..."
    assert re.fullmatch(r"\[quantgate\] measure m FAILED after \d+\.\d s: KeyboardInterrupt", lines[5]), lines[5]


def test_stages_in_several_threads_write_whole_lines(pipe):
    stream, read = pipe

    def work(i: int) -> None:
        for j in range(20):
            with stage(f"stage {i}.{j}"):
                pass

    with terminal_progress(stream=stream):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    lines = read().splitlines()
    assert len(lines) == 4 * 20 * 2
    assert all(re.fullmatch(r"\[quantgate\] stage \d\.\d+ (\.\.\.|done in \d+\.\d s)", line) for line in lines)
    for i in range(4):
        for j in range(20):
            start = lines.index(f"[quantgate] stage {i}.{j} ...")
            end = next(k for k, line in enumerate(lines) if line.startswith(f"[quantgate] stage {i}.{j} done in "))
            assert start < end


def test_a_terminal_gets_the_bars_not_the_lines():
    master, slave = os.openpty()
    os.set_blocking(master, False)
    with os.fdopen(slave, "w") as terminal:
        with terminal_progress(stream=terminal):
            with stage("quantize m -> int8"):
                pass
        terminal.flush()
        out = _read_available(master)  # before the slave closes: a pty master reads EIO after that
    os.close(master)
    assert "quantize m -> int8" in out
    assert "[quantgate]" not in out and "done in" not in out


def test_without_terminal_progress_stages_write_nothing(pipe):
    stream, read = pipe
    with stage("quiet stage"):
        note("only in the run log")
    assert read() == ""
