"""The wheel a user installs: built from this checkout's files with `python -m build`, installed
with its dependencies into a fresh virtualenv, and `kvsched demo` run from that venv in a
directory far from the repository, so it can only use what the wheel ships (the CLI, the
generated protocol code, the trace slice in kvsched/data)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    """The environment without anything that points Python at this checkout or its venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def _run(args: list[str | Path], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert res.returncode == 0, f"{args}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


def _copy_checkout(dest: Path) -> None:
    """The files a clean checkout has (tracked, plus new files git does not ignore), so that
    no build/ or *.egg-info left in the working tree leaks into the wheel."""
    if shutil.which("git") is None:
        pytest.fail("git is not on PATH: the wheel is built from the checkout's files")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():  # a tracked file deleted in the working tree is not copied
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def test_wheel_installs_in_a_fresh_venv_and_runs_the_demo(tmp_path: Path) -> None:
    try:
        import build  # noqa: F401  (the dev extra's `build`: `python -m build` needs it)
    except ImportError:
        pytest.fail("the `build` package is missing: pip install -e '.[dev]' installs it")
    src, dist, env_dir, far = (tmp_path / d for d in ("src", "dist", "venv", "elsewhere"))
    _copy_checkout(src)
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", dist, src], src, 300)
    (wheel,) = dist.glob("kvsched-*.whl")

    # A venv without its own pip (bootstrapping one takes ~15 s): this pip installs into it.
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", wheel], tmp_path, 400)

    far.mkdir()
    shipped = _run(
        [py, "-c", "import kvsched.data as d, kvsched.client; print(d.CONVERSATION_SLICE)"],
        far, 60,
    ).stdout.strip()  # fmt: skip
    # The trace the demo reads by default is the wheel's copy, inside the venv.
    assert Path(shipped).is_relative_to(env_dir) and Path(shipped).is_file(), shipped

    out = far / "demo.json"
    res = _run(
        [env_dir / "bin" / "kvsched", "demo", "--duration", "3", "--time-scale", "5",
         "--workers", "2", "--json", out],
        far, 240,
    )  # fmt: skip
    assert "replaying 3 s of mooncake_conversation_slice.jsonl" in res.stdout, res.stdout
    done = re.search(r"requests \(completed\) +(\d+) \((\d+)\)", res.stdout)
    assert done and int(done[1]) == int(done[2]) > 0, res.stdout
    assert out.is_file()
