"""Set-up from a fresh clone: the README's first command, verbatim, from the root of a clone
of this checkout (its committed HEAD) in a fresh virtual environment.

The environment is fresh but pip's cache and the default model's cache (~/.cache/ott-gguf)
are the user's, as they would be for someone cloning a second time; OTT_NATIVE_DIR and
PYTHONPATH are removed so the installed build is the one that runs.
"""

import os
import re
import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _readme_first_command() -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^    (pip install \. && python -m ott_gguf run .*)$", readme, re.MULTILINE)
    assert m, "README's set-up command not found"
    return m[1]


@pytest.mark.slow
def test_readme_first_command_from_a_fresh_clone(tmp_path):
    clone, env_dir = tmp_path / "clone", tmp_path / "venv"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    venv.create(env_dir, with_pip=True)
    env = {k: v for k, v in os.environ.items() if k not in ("OTT_NATIVE_DIR", "PYTHONPATH", "PYTHONHOME")}
    env["VIRTUAL_ENV"] = str(env_dir)
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = env.get("CMAKE_BUILD_PARALLEL_LEVEL", str(min(os.cpu_count() or 1, 4)))

    out = subprocess.run(
        ["bash", "-c", _readme_first_command()], cwd=clone, env=env, capture_output=True, text=True, timeout=3600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(out.stdout.strip()) > 20, out.stdout  # 32 tokens of text were streamed

    # the converter ships inside the package: no generic top-level `convert` in site-packages
    purelib = subprocess.run(
        [env_dir / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    site = Path(purelib)
    assert not (site / "convert").exists()
    assert (site / "ott_gguf" / "convert" / "converter.py").is_file()
    # and the installed package runs it from anywhere (outside the clone: no source tree on the path)
    help_out = subprocess.run(
        [env_dir / "bin" / "python", "-m", "ott_gguf", "convert", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert help_out.returncode == 0 and "--outtype" in help_out.stdout, help_out.stderr
