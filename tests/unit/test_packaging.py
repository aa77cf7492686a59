"""The wheel holds every module: built from this tree and installed into a directory of its own (no editable
install in the way), each module is there and imports from there. Before first light on a GPU, the wheel had
left blink.engine.kernels out, so every non-editable install (the CUDA image's `pip install .`) lacked the kernels."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

IMPORT_ALL = """
import importlib, sys
target, failed = sys.argv[1], []
for name in sys.argv[2:]:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name.split(".")[0] == "blink":
            failed.append(f"{name}: {e}")
        continue  # an optional dependency this machine lacks (pyverbs, say)
    if not module.__file__.startswith(target):
        failed.append(f"{name} came from {module.__file__}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _source_modules() -> set[str]:
    """Every module of the tree, named as installed (pyproject's package-dir maps blink.X to a top directory)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = set()
    for package, directory in mapping.items():
        for path in (ROOT / directory).rglob("*.py"):
            parts = path.relative_to(ROOT / directory).with_suffix("").parts
            modules.add(".".join((package, *parts)).removesuffix(".__init__"))
    return modules


def test_the_wheel_installs_and_imports_every_module(tmp_path):
    wheels, target, source = tmp_path / "wheels", tmp_path / "site", tmp_path / "source"
    # Built from a copy: setuptools reuses a build/ directory, whose stale modules would hide an omission.
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "tests",
                                                                "results"))
    build = ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(source)]
    subprocess.run([sys.executable, "-m", "pip", *build], check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("blink_serve-*.whl")
    in_wheel = {n.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
                for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    expected = _source_modules()
    assert expected - in_wheel == set(), "modules the wheel leaves out"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(target), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(target), *sorted(expected)], env=env, cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (target / "blink" / "engine" / "assets").is_dir()  # package data: the default model's text
    from blink.engine.kernels import cpu

    for source in cpu.SOURCES:  # and every source the CPU kernels' build compiles
        assert (target / "blink" / "engine" / "kernels" / source.name).is_file()
