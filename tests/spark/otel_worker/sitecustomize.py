"""Tracing in Spark's Python workers, for tests/spark/test_spark_tracing.py.

On ``PYTHONPATH`` of the workers only (``SparkContext.environment``): Python
imports it at start-up. ``RELIABLE_MQ_TEST_SPANS`` names a directory: the
hook leaves a ``started-{pid}`` file there (proof that it ran), and with
``RELIABLE_MQ_TEST_TRACING=on`` it sets a global SDK ``TracerProvider`` whose
exporter appends every ended span as one JSON line to ``spans-{pid}.jsonl``
(a file per process, so concurrent workers never interleave). Otherwise the
workers have the API only, as an application that configured nothing.
"""

from __future__ import annotations

import os


def _install(directory: str) -> None:
    from collections.abc import Sequence

    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        SimpleSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class JsonLines(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            lines = "".join(span.to_json(indent=None) + "\n" for span in spans)
            path = os.path.join(directory, f"spans-{os.getpid()}.jsonl")
            with open(path, "a", encoding="utf-8") as file:
                file.write(lines)
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLines()))
    trace.set_tracer_provider(provider)


_directory = os.environ.get("RELIABLE_MQ_TEST_SPANS")
if _directory:
    with open(os.path.join(_directory, f"started-{os.getpid()}"), "w"):
        pass
    if os.environ.get("RELIABLE_MQ_TEST_TRACING") == "on":
        _install(_directory)
