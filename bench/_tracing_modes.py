"""The tracing dimension of the benches (``--tracing``): the same variant in three set-ups.

Each tracing row runs one measurement in a fresh child process (the bench script
itself, with ``--child MODE --variant NAME``), so the three set-ups differ in one
thing only and never share a heap, a loop or a tracer:

* ``absent``: ``opentelemetry`` cannot be imported at all (``sys.modules`` holds
  ``None`` for it before ``reliable_mq`` is imported): the floor, as if the
  ``otel`` extra were not installed;
* ``api``: the API is installed and no SDK is configured (the API's default
  proxy provider, which the library treats as off): what every user without
  tracing runs, and the row the "API only costs ≤ 3%" claim compares with ``absent``;
* ``sdk``: an SDK ``TracerProvider`` sampling everything (``ALWAYS_ON``) through a
  ``BatchSpanProcessor`` (the production set-up) into an exporter whose ``export``
  only counts and returns ``SUCCESS``, passed as ``tracer_provider=``.

The child prints one line, ``TRACING-SAMPLE {json}``: the bench's own sample
(rate, client CPU µs per message...), the spans exported per message and the
``reliable_mq`` it imported, which must be the parent's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

__all__ = (
    "MODES",
    "ChildFailed",
    "paired",
    "check_mode",
    "provider",
    "row_name",
    "run_child",
    "spans_exported",
    "spans_per_message",
    "summary",
)

MODES = ("absent", "api", "sdk")
LABELS = {
    "absent": "otel not importable",
    "api": "otel API, no SDK",
    "sdk": "SDK always_on, no-op export",
}
MARKER = "TRACING-SAMPLE "

_BLOCKER = """\
import runpy, sys
script, mode = sys.argv[1], sys.argv[2]
if mode == "absent":
    sys.modules["opentelemetry"] = None  # every "import opentelemetry..." now raises ImportError
sys.path.insert(0, sys.argv[3])
sys.argv = [script, *sys.argv[4:]]
runpy.run_path(script, run_name="__main__")
"""

_exporter: Any = None
_spans: dict[str, list[float]] = {}
"""Spans exported per message, by row, as the children reported them."""


def row_name(variant: str, mode: str) -> str:
    """The row of ``variant`` measured in ``mode`` (a child process)."""
    return f"{variant} [{LABELS[mode]}]"


def provider(mode: str) -> Any | None:
    """The ``tracer_provider=`` for ``mode``: an SDK provider for ``sdk``, else None."""
    global _exporter  # noqa: PLW0603 - one provider per child process
    if mode != "sdk":
        return None
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415 - sdk mode only
    from opentelemetry.sdk.trace.export import (  # noqa: PLC0415
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON  # noqa: PLC0415

    class CountingExporter(SpanExporter):
        """Drops every span (after counting it): the SDK's cost without any I/O."""

        def __init__(self) -> None:
            self.spans = 0

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            self.spans += len(spans)
            return SpanExportResult.SUCCESS

    _exporter = CountingExporter()
    sdk = TracerProvider(sampler=ALWAYS_ON)
    sdk.add_span_processor(BatchSpanProcessor(_exporter))
    return sdk


def spans_exported(tracer_provider: Any | None) -> int:
    """Flush ``tracer_provider`` and return how many spans it exported (0 without one)."""
    if tracer_provider is None or _exporter is None:
        return 0
    tracer_provider.force_flush()
    return int(_exporter.spans)


def check_mode(mode: str) -> None:
    """Fail loudly if this child is not in ``mode`` (a row must measure what it says)."""
    from reliable_mq._tracing import Tracing  # noqa: PLC0415 - after the blocker

    loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry."))
    if mode == "absent" and (sys.modules.get("opentelemetry") is not None or loaded):
        raise SystemExit(f"mode absent, yet opentelemetry is loaded: {loaded[:3]}")
    if mode in ("absent", "api") and Tracing().tracer() is not None:
        raise SystemExit(f"mode {mode}: the library would trace (a global provider is set?)")
    if mode == "api" and "opentelemetry.trace" not in sys.modules:
        raise SystemExit("mode api: the library did not import the opentelemetry API")


def emit(sample: dict[str, Any], messages: int, tracer_provider: Any | None) -> None:
    """The child's answer to its parent (one line on stdout)."""
    import reliable_mq  # noqa: PLC0415

    spans = spans_exported(tracer_provider)
    sample = {**sample, "spans_per_message": spans / messages, "reliable_mq": reliable_mq.__file__}
    print(MARKER + json.dumps(sample), flush=True)


class ChildFailed(RuntimeError):
    """A child measurement exited non-zero or printed no sample."""


def run_child(
    script: str, mode: str, variant: str, argv: Sequence[str], row: str | None = None
) -> dict[str, Any]:
    """Measure ``variant`` once in a fresh process in ``mode``; its sample as a dict.

    ``row``: the row it is reported as (default: ``row_name(variant, mode)``)."""
    import reliable_mq  # noqa: PLC0415

    command = [
        sys.executable,
        "-c",
        _BLOCKER,
        os.path.abspath(script),
        mode,
        os.path.dirname(os.path.abspath(script)),
        *argv,
        "--child",
        mode,
        "--variant",
        variant,
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if done.returncode != 0 or not lines:
        raise ChildFailed(f"{variant} [{mode}] exited {done.returncode}:\n{done.stderr[-2000:]}")
    sample: dict[str, Any] = json.loads(lines[-1][len(MARKER) :])
    if sample.pop("reliable_mq") != reliable_mq.__file__:
        raise ChildFailed(f"{variant} [{mode}] imported another reliable_mq than this process")
    _spans.setdefault(row or row_name(variant, mode), []).append(sample["spans_per_message"])
    return sample


def spans_per_message(row: str) -> float | None:
    """The median spans exported per message of a child row (None: not a child row)."""
    found = _spans.get(row)
    return statistics.median(found) if found else None


def summary(
    variants: Sequence[str], value: dict[str, float | None], metric: str, unit: str
) -> list[str]:
    """Lines comparing the modes of each variant: ``api`` vs ``absent``, ``sdk`` vs ``api``."""
    lines = [f"tracing overhead ({metric}; medians of the child rows above):"]
    for variant in variants:
        absent, api, sdk = (value.get(row_name(variant, mode)) for mode in MODES)
        if absent is None or api is None or sdk is None:
            continue
        lines.append(
            f"  {variant}: API only vs not importable {_delta(api, absent, unit)}; "
            f"SDK always_on vs API only {_delta(sdk, api, unit)}"
        )
    return lines


def paired(variants: Sequence[str], per_round: dict[str, list[float]], metric: str) -> list[str]:
    """Lines with the median of the per-round ratios (rows of one round ran minutes apart
    at most, so a ratio within a round is less hit by drift than a ratio of medians)."""
    lines = [f"tracing overhead ({metric}; median of the per-round ratios):"]
    for variant in variants:
        absent, api, sdk = (per_round.get(row_name(variant, mode), []) for mode in MODES)
        if not (absent and api and sdk):
            continue
        api_ratios = [a / b for a, b in zip(api, absent, strict=True) if b]
        sdk_ratios = [a / b for a, b in zip(sdk, api, strict=True) if b]
        rounds = " ".join(f"{ratio:.3f}" for ratio in api_ratios)
        lines.append(
            f"  {variant}: API only / not importable {statistics.median(api_ratios):.3f} "
            f"(rounds: {rounds}); SDK always_on / API only {statistics.median(sdk_ratios):.2f}"
        )
    return lines


def _delta(value: float, base: float, unit: str) -> str:
    if not base:
        return "n/a"
    return f"{value - base:+.1f} {unit} ({(value / base - 1) * 100:+.1f}%)"
