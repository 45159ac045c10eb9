"""Packaging: version, dependency ranges against the lock files, what a wheel carries, declared imports."""

from __future__ import annotations

import ast
import glob
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import jspec
from jspec.cli import main
from jspec.train import lm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _requirements(project, extra=None) -> dict[str, Requirement]:
    reqs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {_norm(Requirement(r).name): Requirement(r) for r in reqs}


def _lock(name: str) -> dict[str, Version]:
    out = {}
    with open(os.path.join(ROOT, name)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                pkg, version = line.split("==")
                out[_norm(pkg)] = Version(version)
    return out


def test_version_is_one_value_everywhere(capsys):
    assert jspec.__version__ == md.version("jspec")
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"jspec {jspec.__version__} (jax {md.version('jax')}")


def test_runtime_dependencies_are_ranges_not_pins(project):
    for name, req in _requirements(project).items():
        ops = {s.operator for s in req.specifier}
        assert "==" not in ops, f"{name} is pinned ({req}): pyproject.toml holds ranges, the lock files the pins"
        assert ops & {">=", ">", "~="}, f"{name} has no lower bound ({req})"


@pytest.mark.parametrize("lock, extras", [("requirements.lock", ()), ("requirements-test.lock", ("test",))])
def test_locks_satisfy_the_ranges(project, lock, extras):
    pins = _lock(lock)
    wanted = dict(_requirements(project))
    for extra in extras:
        wanted.update(_requirements(project, extra))
    for name, req in wanted.items():
        assert name in pins, f"{lock} lacks {name}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{lock}: {name}=={pins[name]} outside {req}"
    if lock == "requirements-test.lock":  # the test lock extends the runtime lock with the same versions
        runtime = _lock("requirements.lock")
        assert {k: v for k, v in pins.items() if k in runtime} == runtime


def test_compile_cache_compresses_with_zstandard():
    """JAX's persistent compilation cache (the `jspec` command's default, and the suite's shared cache) uses
    zstandard when it can import it and zlib otherwise: zlib took 6.6 of a tiny speculative program's 8.3 s
    compile, its weights being constants of that program. The dependency must reach the cache module."""
    from jax._src import compilation_cache

    assert getattr(compilation_cache, "zstd", None) or compilation_cache.zstandard is not None, (
        "jax's compilation cache found no zstandard module: install jspec's locked dependencies "
        "(requirements.lock)")


# The lock's minor releases' neighbours: the older ones are real releases (a fresh venv resolves jspec beside
# them: README "Installing beside a JAX stack"); the newer ones are the next minor versions.
NEIGHBOURS = {"jax": ("0.9.2", "0.11.0"), "jaxlib": ("0.9.2", "0.11.0"), "flax": ("0.11.2", "0.13.0"),
              "numpy": ("2.3.5", "2.5.0")}


@pytest.mark.parametrize("name", sorted(NEIGHBOURS))
def test_ranges_admit_the_neighbouring_minor_releases(project, name):
    req = _requirements(project)[name]
    locked = _lock("requirements.lock")[name]
    older, newer = map(Version, NEIGHBOURS[name])
    assert older.minor == locked.minor - 1 if locked.major == older.major else older < locked
    assert newer.minor == locked.minor + 1
    assert req.specifier.contains(older) and req.specifier.contains(newer), req


def test_every_imported_library_is_declared(project):
    """Each third-party module jspec imports comes from a declared runtime dependency (or an extra for the
    optional features: TensorBoard scalars, the transformers peer benchmark)."""
    declared = set(_requirements(project))
    optional = {n for extra in ("tensorboard", "test") for n in _requirements(project, extra)}
    owners = md.packages_distributions()
    missing = {}
    for path in glob.glob(os.path.join(ROOT, "jspec", "**", "*.py"), recursive=True):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names}:
                if top in sys.stdlib_module_names or top == "jspec":
                    continue
                dists = {_norm(d) for d in owners.get(top, [top])}
                if not dists & (declared | optional):
                    missing.setdefault(top, []).append(os.path.relpath(path, ROOT))
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_builtin_training_configs_ship_with_the_package(tmp_path):
    assert set(lm.builtin_configs()) >= {"code-target", "code-dflash", "code-dspark", "code-dflash2"}
    cfg = lm.load_run_config("builtin:code-dflash", "drafter")
    assert cfg["drafter"]["block_size"] == 8
    with pytest.raises(FileNotFoundError, match=r"no built-in training config 'nope'.*code-dflash"):
        lm.load_run_config("builtin:nope")


def test_wheel_carries_configs_models_license_and_types(tmp_path):
    """Build the wheel as `pip wheel` does and read what an installed jspec would have."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True, env=dict(os.environ, PIP_NO_INPUT="1"))
    (wheel,) = glob.glob(str(tmp_path / "jspec-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for cfg in ("code-target", "code-dflash", "code-dspark", "code-dflash2", "code-eagle3", "code-mtp"):
        assert f"jspec/configs/{cfg}.json" in names
        assert any(n.startswith(f"jspec/builtin/{cfg}/") and n.endswith(".safetensors") for n in names)
    assert "jspec/py.typed" in names
    license_files = [n for n in names if n.endswith("licenses/LICENSE")]
    assert license_files
    text = zipfile.ZipFile(wheel).read(license_files[0]).decode()
    assert "Apache License" in text and "Version 2.0" in text
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    assert f"Version: {jspec.__version__}" in meta
