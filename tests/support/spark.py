"""Fixtures shared by the Spark test modules: one SparkSession, per-test queues.

A pytest plugin (``pytest_plugins`` in ``tests/conftest.py``): one session for
the whole run, which pays the JVM start once. PySpark is imported only when a
test asks for the fixture.

The session runs ``local[2,4]`` (two threads, up to 4 attempts per task: plain
``local[2]`` never retries a task), with the UI off, and its Python workers in
``Europe/Berlin`` (``spark.executorEnv.TZ``): local times with daylight saving
time make any time-zone mistake in the encoders visible.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.support.amqp import run_sync

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

WORKER_TZ = "Europe/Berlin"


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """The one local session of the run (it takes several seconds to start)."""
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    session = (
        SparkSession.builder.master("local[2,4]")
        .appName("reliable_mq-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.executorEnv.TZ", WORKER_TZ)
        .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


async def declare_queue(url: str, name: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True)


async def delete_queue(url: str, name: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(name)


@pytest.fixture(name="spark_queue")
def _spark_queue(broker_url: str) -> Iterator[str]:
    """A fresh durable queue on the shared broker, deleted afterwards."""
    name = f"test-spark-{uuid.uuid4().hex[:12]}"
    run_sync(lambda: declare_queue(broker_url, name))
    yield name
    run_sync(lambda: delete_queue(broker_url, name))
