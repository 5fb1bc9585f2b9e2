"""No module of the library touches a private name of prometheus_client.

An AST walk over every module of ``reliable_mq`` (the AMQP seam, ``_amqp``,
is where the private names of the AMQP libraries are gathered and checked;
prometheus_client has no such place: it is used through its public API only).
A private name is any ``_name`` that prometheus_client's own source defines as
an attribute, reached from outside that source: ``child._sum``,
``getattr(child, "_buckets")``, ``from prometheus_client.x import _thing``.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "reliable_mq"
SEAM = PACKAGE / "_amqp"
_RECEIVERS_OF_OUR_OWN = {"self", "cls"}


def private_attributes(package: str) -> set[str]:
    """Every ``_name`` (not dunder) that ``package``'s source uses as an attribute."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations
    names: set[str] = set()
    for folder in spec.submodule_search_locations:
        for path in Path(folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and _private(node.attr):
                    names.add(node.attr)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def touches(source: str, filename: str, package: str, private: set[str]) -> Iterator[str]:
    """Where ``source`` reaches a private name of ``package``: ``"file:line name"``."""
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == package
        ):
            for alias in node.names:
                if _private(alias.name) or any(_private(p) for p in node.module.split(".")):
                    yield f"{filename}:{node.lineno} from {node.module} import {alias.name}"
        elif isinstance(node, ast.Attribute) and node.attr in private:
            receiver = node.value
            if isinstance(receiver, ast.Name) and receiver.id in _RECEIVERS_OF_OUR_OWN:
                continue  # our own object's attribute (ours may share a name with theirs)
            yield f"{filename}:{node.lineno} .{node.attr}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in private
        ):
            yield f"{filename}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})"


def _library_modules() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if SEAM not in path.parents:
            yield path


class TestPrometheusClient:
    def test_no_module_touches_a_private_name_of_prometheus_client(self) -> None:
        private = private_attributes("prometheus_client")
        found = [
            hit
            for path in _library_modules()
            for hit in touches(
                path.read_text(), str(path.relative_to(ROOT)), "prometheus_client", private
            )
        ]
        assert found == []

    def test_the_walk_finds_what_the_old_metrics_module_did(self) -> None:
        """The check itself: the ways metrics.py once reached inside a histogram are caught."""
        old = (
            "from prometheus_client import Histogram\n"
            "child: Any = self.duration\n"
            "child._sum.inc(total)\n"
            "child._buckets[index].inc(count)\n"
            "bounds = tuple(getattr(child, '_upper_bounds', ()))\n"
            "from prometheus_client.values import _ValueClass\n"
            "self._sum = 0.0\n"  # our own attribute of the same name: not theirs
        )
        private = private_attributes("prometheus_client")
        hits = sorted(touches(old, "old.py", "prometheus_client", private))
        assert hits == [
            "old.py:3 ._sum",
            "old.py:4 ._buckets",
            "old.py:5 getattr(..., '_upper_bounds')",
            "old.py:6 from prometheus_client.values import _ValueClass",
        ]
