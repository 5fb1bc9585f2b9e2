"""Every script in ``examples/`` runs as is against the local broker and exits 0.

Data-driven: a new ``examples/*.py`` is covered without touching this file.
Examples that import pyspark are marked ``spark`` and skip when pyspark is not
importable (the ``spark`` extra). An example's own asserts make it exit non-zero;
``_EXPECTED_LINES`` also pins the figures some examples print.
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
_EXPECTED_LINES = {
    # the replayed micro-batch's 150 totals and 2 malformed events come again,
    # under the same ids, and the inbox skips the totals' copies
    "stream_pipeline": [
        "  micro-batch 0, offsets [earliest, 152): 150 totals, 2 malformed forwarded",
        "  micro-batch 1, offsets [152, 202): 50 totals, 0 malformed forwarded",
        "totals written by Spark: 350 (with the replay), 350 in the queue",
        "malformed events forwarded: 4, 2 distinct ids",
        "inbox: 200 applied, 150 skipped as copies",
        "ledger: 200 rows, 200 orders, 1995000 cents (expected 1995000)",
    ],
}


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


def test_expected_lines_name_examples() -> None:
    """Every example with pinned output exists (a rename must not drop the check)."""
    assert set(_EXPECTED_LINES) <= {path.stem for path in EXAMPLES}


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
    lines = run.stdout.splitlines()
    missing = [line for line in _EXPECTED_LINES.get(path.stem, []) if line not in lines]
    assert not missing, f"{path.name} did not print {missing}\n--- stdout\n{run.stdout[-3000:]}"
