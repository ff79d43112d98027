"""The one build step pyproject.toml cannot declare: the native kernels, compiled into the wheel.

A wheel carries one library per instruction-set level (kvserve/kernels/lib/<level>/), built here
against the torch of the build environment, so an installed kvserve loads the level its CPU runs
and never compiles (kvserve.kernels.loader). The libraries link torch, not Python: the wheel is
tagged py3-none-<platform>. Off x86-64 (the levels are x86's) or with KVSERVE_PREBUILD=0 the wheel
is pure Python (an x86 CPU then compiles its level at the first start; others run the torch
path). An editable install builds nothing here: ``make install`` fills the build cache instead.
"""

import os
import platform
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode or not prebuild():
            return
        sys.path.insert(0, str(Path(__file__).parent))  # this source tree's kvserve, torch-free to import
        from kvserve.kernels import build

        build.write_prebuilt(Path(self.build_lib) / "kvserve" / "kernels" / "lib")


def prebuild() -> bool:
    """Whether this wheel carries kernels: on x86-64 (the levels are x86's; elsewhere the torch path runs)."""
    return os.environ.get("KVSERVE_PREBUILD", "1") != "0" and platform.machine().lower() in ("x86_64", "amd64")


class KernelsDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # binary files: a platform wheel, installed as platlib
        return prebuild()


class PlatformWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        return ("py3", "none", plat) if prebuild() else (python, abi, plat)


setup(distclass=KernelsDistribution, cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel})
