"""The servers `quantgate bench peers` compares: parse `--serve` specs, start one on a free loopback
port in its own process group, wait until it is healthy, and stop the whole group afterwards.

    quantgate[:[VARIANT] ARGS]  `quantgate serve` from this venv on the model or one of its variants
                                (`quantgate:int4wo`), ARGS appended (e.g. `quantgate:--dtype bfloat16`)
    vllm[:ARGS]                 vLLM's CPU build from its own venv (scripts/peers_setup.sh), bf16 unless ARGS say
    llama[:[TYPE] ARGS]         llama.cpp's llama-server (scripts/peers_setup_llama.sh) on the model's GGUF as
                                TYPE (F16 by default; Q8_0, Q4_0, ... made once with llama-quantize)
    url=URL                     a server that is already running; nothing is started or stopped
"""

from __future__ import annotations

import contextlib
import glob
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.llama_peer import llama_binary, llama_version
from benchmarks.peer_isa import forced_env
from quantgate.ports import free_port
from quantgate.services import healthy

VLLM_DEFAULT_ARGS = ["--dtype", "bfloat16", "--max-model-len", "2048"]
# 16 slots of 512 tokens (the peers workload's longest request): continuous batching across the slots.
LLAMA_DEFAULT_ARGS = ["--parallel", "16", "--ctx-size", "8192"]
LLAMA_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K_M", "Q4_0", "Q4_1", "Q4_K_M")
KINDS = ("quantgate", "vllm", "llama")
TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4",
                  "/usr/lib/libtcmalloc_minimal.so.4")


@dataclass
class ServerSpec:
    kind: str  # "quantgate", "vllm", "llama" or "url"
    args: list[str] = field(default_factory=list)
    url: str | None = None
    weights: str | None = None  # a quantgate variant (None: the model itself) or a llama.cpp GGUF type

    @property
    def label(self) -> str:
        if self.kind == "url":
            return str(self.url)
        if self.kind == "quantgate":
            return " ".join(["quantgate serve", *([self.weights] if self.weights else []), *self.args])
        if self.kind == "llama":
            return " ".join(["llama.cpp", self.weights or "F16", *self.args])
        dtype = [] if "--dtype" in self.args else VLLM_DEFAULT_ARGS[:2]  # vLLM's own default would be fp32
        return " ".join(["vLLM CPU", *dtype, *self.args])


@dataclass
class PeerPaths:
    """Where the peers live, each outside the project's venv (default: under $QUANTGATE_HOME/peers), and
    the instruction set every server is forced onto (None: each its own pick; benchmarks/peer_isa.py)."""
    vllm_venv: Path
    llama_dir: Path
    isa: str | None = None


@dataclass
class Running:
    url: str
    startup_s: float | None = None
    pid: int | None = None
    log: Path | None = None
    version: str | None = None


def parse_serve(text: str) -> ServerSpec:
    if text.startswith("url="):
        url = text[4:].rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--serve url=... needs an http(s) URL, got {text!r}")
        return ServerSpec("url", url=url)
    kind, _, rest = text.partition(":")
    if kind not in KINDS:
        raise ValueError(f"--serve takes quantgate[:ARGS], vllm[:ARGS], llama[:ARGS] or url=URL, got {text!r}")
    args = shlex.split(rest)
    weights = args.pop(0) if args and not args[0].startswith("-") else None
    if weights and kind == "vllm":
        raise ValueError(f"--serve {text!r}: vLLM serves the model itself (no variant word), got {weights!r}")
    if kind == "llama":
        weights = (weights or "F16").upper()
        if weights not in LLAMA_TYPES:
            raise ValueError(f"--serve {text!r}: llama.cpp type {weights!r} is not one of {', '.join(LLAMA_TYPES)}")
    return ServerSpec(kind, args, weights=weights)


def _cpu_bind() -> str:
    cpus = sorted(os.sched_getaffinity(0))
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def vllm_env(venv: Path) -> dict[str, str]:
    """What vLLM's CPU docs ask for (see shared/notes/dependencies.md); the caller's own values win."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": _cpu_bind(),
           "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
    preload = [p for p in TCMALLOC_PATHS if Path(p).is_file()][:1] + glob.glob(str(venv / "lib" / "libiomp5.so"))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return {**env, **os.environ}


def vllm_version(venv: Path) -> str | None:
    found = glob.glob(str(venv / "lib" / "python*" / "site-packages" / "vllm_cpu-*.dist-info"))
    return Path(found[0]).name.removeprefix("vllm_cpu-").removesuffix(".dist-info") if found else None


def command(spec: ServerSpec, port: int, weights: Path, served_name: str, peers: PeerPaths) -> list[str]:
    """`weights` is what this spec serves: a HF dir (quantgate, vLLM) or a GGUF file (llama.cpp)."""
    if spec.kind == "llama":
        server = llama_binary(peers.llama_dir, "llama-server")
        return [str(server), "--model", str(weights), "--alias", served_name, "--host", "127.0.0.1",
                "--port", str(port), *LLAMA_DEFAULT_ARGS, "--threads", str(len(os.sched_getaffinity(0))), *spec.args]
    common = ["--model", str(weights), "--served-model-name", served_name, "--host", "127.0.0.1",
              "--port", str(port)]
    if spec.kind == "quantgate":
        return [sys.executable, "-m", "quantgate.cli", "serve", *common, "--log-level", "warning", *spec.args]
    python = peers.vllm_venv / "bin" / "python"
    if not python.is_file():
        raise ValueError(f"no vLLM venv at {peers.vllm_venv}: build it with scripts/peers_setup.sh "
                         "(or pass --vllm-venv)")
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", *common, *VLLM_DEFAULT_ARGS, *spec.args]


def _version(spec: ServerSpec, peers: PeerPaths) -> str | None:
    if spec.kind == "vllm":
        return vllm_version(peers.vllm_venv)
    return llama_version(peers.llama_dir) if spec.kind == "llama" else None


def _healthy(url: str) -> bool:
    return all(healthy(url + path, timeout_s=5) for path in ("/health", "/v1/models"))


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.is_file() else ""


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> float:
    start = time.monotonic()
    while not _healthy(url):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy:\n{_tail(log)}")
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"the server was not healthy within {timeout_s:.0f} s:\n{_tail(log)}")
        time.sleep(1.0)
    return time.monotonic() - start


def stop_group(proc: subprocess.Popen) -> None:
    """SIGINT the server's process group, then SIGTERM, then SIGKILL whatever of the group is left."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGTERM, 15)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)  # children the leader left behind
    proc.wait(10)


@contextlib.contextmanager
def started(spec: ServerSpec, *, weights: Path, served_name: str, peers: PeerPaths, log_dir: Path,
            startup_timeout_s: float = 900.0) -> Iterator[Running]:
    """The server of `spec`, healthy; a started one is stopped (its whole process group) on exit."""
    if spec.kind == "url":
        yield Running(str(spec.url))
        return
    port = free_port()
    cmd = command(spec, port, weights, served_name, peers)
    env = forced_env(vllm_env(peers.vllm_venv) if spec.kind == "vllm" else dict(os.environ), spec.kind, peers.isa)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{spec.kind}-{port}.log"
    with log.open("w") as out:
        out.write(f"$ {shlex.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        startup = wait_healthy(proc, url, log, startup_timeout_s)
        version = _version(spec, peers)
        yield Running(url, startup, proc.pid, log, version)
    finally:
        stop_group(proc)
