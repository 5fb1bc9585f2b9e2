"""The install the docs describe works: the wheel and the sdist install into clean venvs.

``python -m build`` (the ``build`` package, in the dev extra) makes both from
this checkout, as the getting-started page says; each is then installed with
pip into a virtual environment of its own (no system site packages, no
editable install of this checkout) and must import, and run the
``reliable-mq`` command. The two installs run side by side to stay well under
a minute and a half.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parent.parent
_CHECK = (
    "import reliable_mq, reliable_mq.cli, reliable_mq.dedup, reliable_mq.testing; "
    "assert reliable_mq.__file__.startswith({prefix!r}), reliable_mq.__file__; "
    "print(reliable_mq.__version__)"
)


def _env() -> dict[str, str]:
    # No PYTHONPATH or venv of ours may leak into the clean environments.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_wheel_and_sdist_install_into_clean_venvs(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=_env(),
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels = list(dist.glob("reliable_mq-*.whl"))
    sdists = list(dist.glob("reliable_mq-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(dist.iterdir())
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = wheel.namelist()
    assert "reliable_mq/py.typed" in names
    assert not [n for n in names if n.startswith(("tests/", "docs/", ".venv"))], names
    with tarfile.open(sdists[0]) as sdist:
        members = sdist.getnames()
    assert not [m for m in members if "/.venv/" in m or "__pycache__" in m]

    installs = {}
    for artifact in (wheels[0], sdists[0]):
        venv = tmp_path / f"venv-{artifact.suffix.strip('.')}"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        installs[artifact] = (
            venv,
            subprocess.Popen(
                [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(artifact)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=_env(),
                cwd=tmp_path,
            ),
        )
    for artifact, (venv, process) in installs.items():
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"{artifact.name}: {output[-3000:]}"
        python = venv / "bin" / "python"
        check = subprocess.run(
            [str(python), "-c", _CHECK.format(prefix=str(venv))],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=tmp_path,  # not the checkout: the import must come from the venv
            env=_env(),
        )
        assert check.returncode == 0, f"{artifact.name}: {check.stderr[-3000:]}"
        assert check.stdout.strip() == "0.1.0"
        command = subprocess.run(
            [str(venv / "bin" / "reliable-mq"), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=_env(),
        )
        assert command.returncode == 0 and "0.1.0" in command.stdout, command
