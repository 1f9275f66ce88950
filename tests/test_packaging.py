"""Installing tokenmill: the editable install must not lose to the clone's own folder.

A user's script saved in the folder that holds the clone (a folder named `tokenmill`)
used to fail with "cannot import name 'LLM' from 'tokenmill' (unknown location)":
setuptools' editable import hook runs after Python has already taken that folder for a
namespace package. pyproject.toml's `package-dir` makes `pip install -e .` write a plain
path into a .pth file instead, and a real package on sys.path beats a namespace folder.

The test builds the editable wheel with setuptools' own PEP 660 hook (what pip calls)
and unpacks it into a scratch site folder: `pip install --prefix` would also uninstall
the tokenmill that the test environment itself runs on.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOT_COPIED = (".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".*_cache")


def test_editable_install_wins_over_a_clone_folder_beside_the_script(tmp_path):
    clone = tmp_path / "tokenmill"  # the clone, under the name `git clone` gives it
    shutil.copytree(REPO, clone, ignore=shutil.ignore_patterns(*NOT_COPIED, ".hypothesis"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build = f"from setuptools import build_meta; print(build_meta.build_editable({str(wheels)!r}))"
    r = subprocess.run(
        [sys.executable, "-c", build], cwd=clone, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr
    wheel = wheels / r.stdout.strip().splitlines()[-1]
    site_dir = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:  # what pip would put in site-packages
        zf.extractall(site_dir)
    # A script in tmp_path (beside the clone) that sees only this installation: -S skips
    # the test environment's own site-packages, -E its PYTHONPATH, and addsitedir reads
    # the installed .pth files as site-packages would.
    script = (
        f"import site; site.addsitedir({str(site_dir)!r})\n"
        "import tokenmill\n"
        "print(tokenmill.__file__)\n"
    )
    r = subprocess.run(
        [sys.executable, "-S", "-E", "-c", script], capture_output=True, text=True, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(clone / "tokenmill" / "__init__.py")
