"""Builds the GoogleTest kernel tests with CMake and runs them under ctest, so the one test command covers
C++ too. CUDA tests are compiled wherever nvcc is found and skip themselves when no GPU is present."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cpp_kernel_tests_pass(tmp_path_factory):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake is required for the C++ tests (pip install cmake)")
    build = ROOT / "build" / "ctest"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    jobs = str(max(os.cpu_count() or 2, 2))
    cfg = subprocess.run([cmake, "-S", str(ROOT), "-B", str(build), *gen, "-DMETALATTN_BUILD_PYTHON=OFF",
                          "-DMETALATTN_BUILD_TESTS=ON", "-DCMAKE_BUILD_TYPE=Release"],
                         capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    bld = subprocess.run([cmake, "--build", str(build), "-j", jobs], capture_output=True, text=True)
    assert bld.returncode == 0, bld.stdout[-8000:] + bld.stderr[-8000:]
    test = subprocess.run(["ctest", "--test-dir", str(build), "--output-on-failure", "-j", jobs],
                          capture_output=True, text=True)
    print(test.stdout[-4000:])
    assert test.returncode == 0, test.stdout[-8000:] + test.stderr[-4000:]
