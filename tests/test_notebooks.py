"""colab/: notebooks (1)-(3) run top to bottom on a CPU with their QUICK settings; (4) runs until it
needs the user's checkpoint folders, then stops with instructions."""

from __future__ import annotations

import os

import jax
import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

COLAB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "colab")
NOTEBOOKS = sorted(f for f in os.listdir(COLAB) if f.endswith(".ipynb"))
# Lines the notebooks print only after their own checks passed.
RUNS = {
    "01_quickstart.ipynb": ["identical tokens: True", "sampled at T=0.8, identical tokens: True"],
    "02_verification_rules.ipynb": ["mixed (wrong): max |output - target| = ", "gumbel (T=1): tau"],
    "03_train_a_drafter.ipynb": ["drafter written to", "with the trained drafter"],
}


def _client(name, tmp_path, monkeypatch, **env):
    monkeypatch.setenv("JSPEC_QUICK", "1")
    # Headless: the inline back end renders each figure with Agg into the notebook as a PNG.
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(os.path.join(COLAB, name), as_version=4)
    # The kernel runs in tmp_path (the notebooks write their models and runs under the working directory).
    return nb, NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def test_notebooks_are_stored_clean_and_install_jspec_first():
    assert NOTEBOOKS == sorted([*RUNS, "04_bring_your_own_checkpoint.ipynb"])
    for name in NOTEBOOKS:
        nb = nbformat.read(os.path.join(COLAB, name), as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), f"{name} is stored with outputs"
        first = code[0].source
        assert "find_spec(\"jspec\")" in first and "pip\", \"install\"" in first, name


@pytest.mark.parametrize("name", sorted(RUNS))
def test_notebook_runs_top_to_bottom(name, tmp_path, monkeypatch):
    nb, client = _client(name, tmp_path, monkeypatch)
    client.execute()
    printed = "".join(_text(c) for c in nb.cells)
    for line in RUNS[name]:
        assert line in printed, (name, line)
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, f"{name} drew no plot"


def test_bring_your_own_checkpoint_stops_and_asks_for_the_folders(tmp_path, monkeypatch):
    missing = str(tmp_path / "no-such-model")
    nb, client = _client("04_bring_your_own_checkpoint.ipynb", tmp_path, monkeypatch, JSPEC_TARGET_DIR=missing,
                         JSPEC_DRAFTER_DIR=str(tmp_path / "no-such-drafter"))
    with pytest.raises(CellExecutionError) as err:
        client.execute()
    message = str(err.value)
    assert f"target folder not found: {missing!r}" in message
    assert "config.json, *.safetensors, tokenizer.json" in message and "set TARGET_DIR" in message
    code = [c for c in nb.cells if c.cell_type == "code"]
    stop = next(i for i, c in enumerate(code) if "check_folder(TARGET_DIR" in c.source)
    assert all(c.execution_count is not None for c in code[: stop + 1])  # everything before ran
    assert all(c.execution_count is None for c in code[stop + 1:])  # nothing after did
    assert f"jax {jax.__version__} on " in "".join(_text(c) for c in code[:stop])


def _install_cell() -> str:
    nb = nbformat.read(os.path.join(COLAB, NOTEBOOKS[0]), as_version=4)
    return next(c for c in nb.cells if c.cell_type == "code").source


def test_every_notebook_has_the_same_install_cell_and_no_placeholder_address():
    for name in NOTEBOOKS:
        nb = nbformat.read(os.path.join(COLAB, name), as_version=4)
        source = next(c for c in nb.cells if c.cell_type == "code").source
        assert source == _install_cell(), name
    assert "YOUR_ORG" not in _install_cell() and "github.com" not in _install_cell()


@pytest.mark.parametrize("where", ["checkout", "wheel", "elsewhere", "nonsense"])
def test_install_cell_installs_from_a_checkout_or_a_wheel(where, tmp_path, monkeypatch):
    """The cell's pip command for each JSPEC_PIP, checked by pip itself (a dry run without dependencies)."""
    import importlib.util
    import pathlib
    import shutil
    import subprocess
    import sys

    root = os.path.dirname(COLAB)
    if where == "wheel":
        subprocess.run([sys.executable, "-m", "pip", "wheel", root, "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path)], check=True, capture_output=True)
        value = next(str(p) for p in tmp_path.glob("jspec-*.whl"))
    else:
        value = {"checkout": root, "elsewhere": str(tmp_path), "nonsense": "no-such-thing"}[where]
    if where == "wheel":  # a folder with a space, as on a mounted Drive ("My Drive")
        spaced = tmp_path / "My Drive"
        spaced.mkdir()
        value = shutil.copy(value, spaced)
    monkeypatch.setenv("JSPEC_PIP", value)
    commands = []
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "jspec" else real_find_spec(n, *a))
    monkeypatch.setattr(subprocess, "check_call", lambda cmd, **kw: commands.append(cmd))
    if where in ("elsewhere", "nonsense"):
        with pytest.raises(FileNotFoundError, match="JSPEC_PIP|no jspec checkout"):
            exec(_install_cell(), {})
        return
    exec(_install_cell(), {})
    (cmd,) = commands
    assert cmd[-1].startswith("jspec") and cmd[-1].endswith(f" @ {pathlib.Path(value).resolve().as_uri()}")
    monkeypatch.undo()
    check = subprocess.run(cmd[:-1] + ["--dry-run", "--no-deps", "--no-build-isolation", "--report", "-", cmd[-1]],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert '"name": "jspec"' in check.stdout.replace("'", '"')
