"""Which reliable_mq a bench measured: its path, its commit and a label, for the JSON.

A before/after run imports an older reliable_mq through ``PYTHONPATH`` (see
docs/performance.md, "Reproduce"); every bench prints and records which one it
got, so a figure can never be credited to the wrong code. The commit comes from
git when the package's files are tracked in a git work tree (``+dirty`` when its files have
uncommitted changes), else from a ``COMMIT`` file next to the package (write one
when you extract a ``git archive``), else it is unknown.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ("describe", "origin")


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=False, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def origin(package: ModuleType, label: str | None = None) -> dict[str, Any]:
    """``{"path", "commit", "label"}`` of an imported package (``reliable_mq``)."""
    path = Path(package.__file__ or ".").resolve().parent
    root = path.parent
    tracked = _git(root, "ls-files", "--", f"{path.name}/__init__.py")
    commit = _git(root, "rev-parse", "--short=12", "HEAD") if tracked else None
    if commit is not None:
        if _git(root, "status", "--porcelain", "--", path.name):
            commit += "+dirty"
    else:
        marker = root / "COMMIT"
        if marker.is_file():
            commit = marker.read_text().strip()[:12] or None
    return {
        "path": str(path),
        "commit": commit,
        "label": label or commit or "unlabelled",
        "pythonpath": os.environ.get("PYTHONPATH", ""),
    }


def describe(found: dict[str, Any]) -> str:
    """One line for the console: ``reliable_mq from PATH (commit X, label Y)``."""
    return (
        f"reliable_mq from {found['path']} (commit {found['commit'] or 'unknown'}, "
        f"label {found['label']!r})"
    )
