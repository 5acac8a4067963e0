"""A plain `pip install slicesched` (no extras) in a fresh virtual environment serves a capacity
planner: no torch, no transformers, and the simulator, replay, capacity search and CLI work; the
executor's commands say in one line which extra to install."""

from __future__ import annotations

import shutil
import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("plain-install")  # one venv, built once, on one worker


@pytest.fixture(scope="module")
def plain_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the package installed from a copy of the source, no extras."""
    root = tmp_path_factory.mktemp("plain-install")
    src = root / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "constraints-dev.txt"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    env = root / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    py = env / "bin" / "python"
    done = subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(src / "constraints-dev.txt"), str(src)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return env / "bin"


def test_plain_install_has_no_torch(plain_install: Path) -> None:
    for module in ("torch", "transformers"):
        done = subprocess.run([str(plain_install / "python"), "-c", f"import {module}"], capture_output=True)
        assert done.returncode != 0, f"{module} is importable after a plain install"


def test_plain_install_searches_capacity_on_the_builtin_scenario(plain_install: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run([str(plain_install / "slicesched"), "replay", "--capacity", "--duration", "5",
                           "--seeds", "1", "--no-plots", "--jobs", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "capacity.csv").stat().st_size > 0
    assert "slicesched" in (out / "capacity.csv").read_text()


@pytest.mark.parametrize("args", [["profile"], ["fidelity"], ["replay", "--backend", "executor"]])
def test_executor_commands_name_the_extra_to_install(plain_install: Path, tmp_path: Path, args: list[str]) -> None:
    done = subprocess.run([str(plain_install / "slicesched"), *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'slicesched[executor]'" in lines[0], done.stderr

