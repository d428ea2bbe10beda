"""Building a wheel compiles what runs inside targets and carries the BPF sources (pyproject.toml
holds everything else): an installed allocsampler needs no compiler and writes nothing into its
install tree (sampler/inprocess/build.py, sampler/bpf/__init__.py).

- build_py compiles the preload shim, the injected sampler and the placement helper into
  sampler/inprocess/prebuilt/, and copies the top-level bpf/ to sampler/bpf/programs/.
- The wheel is tagged py3-none-<platform>: its compiled files are x86-64 Linux code that no
  Python ABI concerns. An editable install (a checkout) builds nothing: it builds at run time.
"""

import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:                 # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        lib = Path(self.build_lib)
        programs = lib / "sampler" / "bpf" / "programs"
        shutil.rmtree(programs, ignore_errors=True)
        programs.mkdir(parents=True)
        for src in sorted((HERE / "bpf").iterdir()):
            if src.suffix in (".c", ".h"):
                shutil.copy2(src, programs / src.name)
        sys.path.insert(0, str(HERE))
        from sampler.errors import AllocsamplerError
        from sampler.inprocess import build as inprocess
        prebuilt = lib / "sampler" / "inprocess" / "prebuilt"
        shutil.rmtree(prebuilt, ignore_errors=True)
        try:
            for out in inprocess.compile_all(prebuilt):
                print(f"compiled {out.relative_to(lib)}")
        except AllocsamplerError as e:
            sys.exit(f"allocsampler: error: {e}")


class Platform(Distribution):
    def has_ext_modules(self) -> bool:     # a platform wheel, installed as one tree (platlib)
        return True


class Wheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        return "py3", "none", super().get_tag()[2]


setup(distclass=Platform, cmdclass={"build_py": BuildPy, "bdist_wheel": Wheel})
