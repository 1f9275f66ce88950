"""`tokenmill info` names every environment variable the package reads (issue 23: three had
been left out of its list), so a bug report shows the settings that changed what ran."""

from __future__ import annotations

import re
from pathlib import Path

import tokenmill
from tokenmill.cli import info

PACKAGE = Path(tokenmill.__file__).parent
NAME = re.compile(r"\bTOKENMILL_[A-Z0-9_]+\b")


def _names_in_the_package() -> dict[str, str]:
    """Every TOKENMILL_* named in the package's Python and C sources (read through
    os.environ, getenv or a constant such as API_KEY_ENV), but for info.py's own list:
    {name: the first file that names it}."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".c", ".h") or path == Path(info.__file__):
            continue
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, str(path.relative_to(PACKAGE)))
    return found


def test_every_tokenmill_variable_is_listed():
    listed = {v for v in (*info.ENV_VARS, *info.SECRET_ENV_VARS) if v.startswith("TOKENMILL_")}
    found = _names_in_the_package()
    missing = {name: where for name, where in found.items() if name not in listed}
    assert not missing, f"add to cli/info.py's ENV_VARS (or SECRET_ENV_VARS): {missing}"
    assert listed <= set(found), f"listed but read nowhere: {sorted(listed - set(found))}"
    # what issue 23 found missing stays listed
    assert {"TOKENMILL_MARCH", "TOKENMILL_FUSED_DECODE", "TOKENMILL_DIST_TIMEOUT"} <= listed


def test_a_secret_is_said_to_be_set_but_not_shown(monkeypatch):
    monkeypatch.setenv("TOKENMILL_API_KEY", "sk-do-not-print")
    monkeypatch.setenv("TOKENMILL_DIST_TIMEOUT", "90")
    rows = [value for label, value in info.facts() if label == "env"]
    assert "TOKENMILL_DIST_TIMEOUT=90" in rows
    assert "TOKENMILL_API_KEY is set (not shown)" in rows
    assert not any("sk-do-not-print" in value for value in rows)
