"""Every script in ``examples/`` runs as is against the local broker and exits 0.

Data-driven: a new ``examples/*.py`` is covered without touching this file.
Examples that import pyspark are marked ``spark`` and skip when pyspark is not
importable (the ``spark`` extra).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
_PYSPARK_IMPORT = re.compile(r"^\s*(from|import)\s+pyspark\b", re.MULTILINE)
_TIMEOUT = 120
_SPARK_TIMEOUT = 300


def _uses_spark(path: Path) -> bool:
    return bool(_PYSPARK_IMPORT.search(path.read_text()))


def _cases() -> list[object]:
    cases: list[object] = []
    for path in EXAMPLES:
        marks = [pytest.mark.rabbitmq]
        if _uses_spark(path):
            marks.append(pytest.mark.spark)
            if importlib.util.find_spec("pyspark") is None:
                marks.append(pytest.mark.skip(reason="pyspark is not installed (spark extra)"))
        cases.append(pytest.param(path, marks=marks, id=path.stem))
    return cases


def test_there_are_examples() -> None:
    """The glob finds the examples (a moved folder must not make the suite vacuous)."""
    assert EXAMPLES


@pytest.mark.parametrize("path", _cases())
def test_example_runs(path: Path, broker_url: str) -> None:
    """The example finishes by itself with exit code 0."""
    env = dict(os.environ)
    env.setdefault("RELIABLE_MQ_URL", broker_url)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    timeout = _SPARK_TIMEOUT if _uses_spark(path) else _TIMEOUT
    try:
        run = subprocess.run(
            [sys.executable, str(path)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{path.name} did not finish within {timeout}s")
    assert run.returncode == 0, (
        f"{path.name} exited {run.returncode}\n--- stdout\n{run.stdout[-3000:]}"
        f"\n--- stderr\n{run.stderr[-3000:]}"
    )
