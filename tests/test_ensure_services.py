"""``scripts/ensure-services.sh`` with ``REQUIRE_POSTGRES=1``.

The path taken when PostgreSQL is up runs against the real server on 5432.
The path that starts a stopped cluster runs with stand-ins for ``pg_isready``,
``pg_ctlcluster`` and ``psql`` first on ``PATH``: the real server is never
stopped, started or changed by these tests. (The path that installs
PostgreSQL with apt is not run here.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.rabbitmq  # the script also checks RabbitMQ, for real

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "ensure-services.sh"


def _run(env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _clusters() -> list[str]:
    return sorted(p.parent.name for p in Path("/etc/postgresql").glob("*/main"))


def _stubs(folder: Path, *, starts: bool) -> Path:
    """Stand-ins that log their arguments; the server "accepts" once started."""
    log = folder / "calls.log"
    started = folder / "started"
    scripts = {
        "pg_isready": f'echo "pg_isready $*" >> {log}; [ -e {started} ]',
        "pg_ctlcluster": (
            f'echo "pg_ctlcluster $*" >> {log}; '
            + (f"touch {started}" if starts else 'echo "could not start" >&2; exit 1')
        ),
        # Only the database "postgres" exists; every other statement succeeds.
        "psql": (
            f'echo "psql $*" >> {log}; '
            'case "$*" in *"datname = \'postgres\'"*) echo 1 ;; esac; exit 0'
        ),
    }
    for name, body in scripts.items():
        path = folder / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)
    return log


class TestPostgres:
    def test_an_up_server_is_left_alone_silently(self, broker_url: str) -> None:
        """PostgreSQL already accepts connections: exit 0, nothing said, nothing started."""
        run = _run({"REQUIRE_POSTGRES": "1"})
        assert run.returncode == 0, run.stderr
        assert run.stderr == ""

    def test_a_stopped_cluster_is_started_awaited_and_its_databases_made(
        self, broker_url: str, tmp_path: Path
    ) -> None:
        """Down: ``pg_ctlcluster VERSION main start``, wait, then create missing databases."""
        clusters = _clusters()
        if not clusters:
            pytest.skip("no Debian PostgreSQL cluster under /etc/postgresql")
        log = _stubs(tmp_path, starts=True)
        run = _run(
            {
                "REQUIRE_POSTGRES": "1",
                "POSTGRES_DATABASES": "postgres outbox_extra",
                "PATH": f"{tmp_path}:{os.environ['PATH']}",
            }
        )
        assert run.returncode == 0, run.stderr
        calls = log.read_text().splitlines()
        starts = [c for c in calls if c.startswith("pg_ctlcluster")]
        assert starts == [f"pg_ctlcluster --skip-systemctl-redirect {clusters[-1]} main start"]
        assert not any(" stop" in c or "restart" in c for c in calls)
        assert any("CREATE DATABASE outbox_extra" in c for c in calls), calls
        assert not any("CREATE DATABASE postgres" in c for c in calls)
        assert (
            "starting PostgreSQL" in run.stderr and "creating database outbox_extra" in run.stderr
        )

    def test_a_cluster_that_will_not_start_fails_the_script(
        self, broker_url: str, tmp_path: Path
    ) -> None:
        """Required, down and unstartable: a non-zero exit naming PostgreSQL."""
        if not _clusters():
            pytest.skip("no Debian PostgreSQL cluster under /etc/postgresql")
        _stubs(tmp_path, starts=False)
        run = _run(
            {
                "REQUIRE_POSTGRES": "1",
                "POSTGRES_START_TIMEOUT": "2",
                "PATH": f"{tmp_path}:{os.environ['PATH']}",
            }
        )
        assert run.returncode == 1
        assert "pg_ctlcluster" in run.stderr and "REQUIRE_POSTGRES=1" in run.stderr

    def test_not_required_means_not_touched(self, broker_url: str, tmp_path: Path) -> None:
        """Without REQUIRE_POSTGRES the script does not look at PostgreSQL at all."""
        log = _stubs(tmp_path, starts=False)
        run = _run({"REQUIRE_POSTGRES": "0", "PATH": f"{tmp_path}:{os.environ['PATH']}"})
        assert run.returncode == 0, run.stderr
        assert not log.exists()
