"""The seam's boundary, checked on the source: only ``reliable_mq._amqp`` imports aiormq,
pamqp or aio-pika (import-linter), and only ``reliable_mq._amqp.hooks`` touches a
private name of theirs, or of prometheus_client (this module's AST walk).

A dependency's private names are read from its own source: every ``_name`` it
defines (functions, classes, module globals, attributes it assigns, name-mangled
``__name`` as ``_Class__name``), so instance attributes set in ``__init__`` count too.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "reliable_mq"
HOOKS = PACKAGE / "_amqp" / "hooks.py"
DEPENDENCIES = ("aiormq", "aio_pika", "pamqp", "prometheus_client")
_BY_NAME = frozenset({"getattr", "setattr", "hasattr", "delattr", "getattr_static"})
_NAMEDTUPLE_API = frozenset({"_asdict", "_replace", "_fields", "_make", "_field_defaults"})

ALLOWED: dict[str, set[str]] = {}
"""Modules allowed to touch a dependency's private names besides the hooks module: none
(metrics.py read prometheus_client's histogram children until its public-API collector)."""


def _private(name: str) -> bool:
    return (
        len(name) > 1
        and name.startswith("_")
        and not (name.startswith("__") and name.endswith("__"))
    )


@cache
def private_names(dependency: str) -> frozenset[str]:
    """Every private name ``dependency``'s source defines or assigns."""
    spec = importlib.util.find_spec(dependency)
    assert spec is not None and spec.origin is not None, dependency
    names: set[str] = set()
    for path in Path(spec.origin).parent.rglob("*.py"):
        _Definitions(names).visit(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(names - _NAMEDTUPLE_API)


class _Definitions(ast.NodeVisitor):
    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.classes: list[str] = []

    def add(self, name: str) -> None:
        if name.startswith("__") and not name.endswith("__") and self.classes:
            self.names.add(f"_{self.classes[-1].lstrip('_')}{name}")  # name-mangled
        elif _private(name):
            self.names.add(name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.add(node.name)
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.add(node.name)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Store):
            self.add(node.attr)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.add(node.id)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if isinstance(node.target, ast.Name):
            self.add(node.target.id)
        self.generic_visit(node)


def touches(path: Path) -> list[tuple[int, str, str]]:
    """``(line, name, dependency)`` for each private name of a dependency ``path`` uses.

    Attribute accesses on anything but ``self``/``cls``, names given as strings to
    ``getattr`` and friends, and private names imported from a dependency.
    """
    found: list[tuple[int, str, str]] = []

    def check(line: int, name: str, only: tuple[str, ...] = DEPENDENCIES) -> None:
        if _private(name):
            found.extend((line, name, dep) for dep in only if name in private_names(dep))

    tree = ast.parse(path.read_text(encoding="utf-8"))
    slots = {  # our own attribute names, whatever a dependency calls its own
        id(constant)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets)
        for constant in ast.walk(node.value)
    }
    for node in ast.walk(tree):
        if id(node) in slots:
            continue
        if isinstance(node, ast.Attribute):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                check(node.lineno, node.attr)
        elif isinstance(node, ast.Call):
            function = node.func
            called = function.attr if isinstance(function, ast.Attribute) else None
            called = function.id if isinstance(function, ast.Name) else called
            if called in _BY_NAME and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    check(node.lineno, name.value)
        elif isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            if top in DEPENDENCIES:
                for alias in node.names:
                    check(node.lineno, alias.name, (top,))
    return found


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


class TestPrivateNames:
    def test_only_the_hooks_module_touches_private_names_of_dependencies(self) -> None:
        """No module but ``_amqp/hooks.py`` uses a private name of aiormq, aio-pika, pamqp
        or prometheus_client (the seam's other modules included)."""
        violations = []
        for path in sorted(PACKAGE.rglob("*.py")):
            if path == HOOKS:
                continue
            allowed = ALLOWED.get(_relative(path), set())
            for line, name, dependency in touches(path):
                if dependency not in allowed:
                    violations.append(f"{_relative(path)}:{line}: {dependency} {name}")
        assert violations == []

    def test_no_stale_allowance(self) -> None:
        """An allowance is removed with the code it allowed."""
        for relative, dependencies in ALLOWED.items():
            used = {dependency for _, _, dependency in touches(ROOT / relative)}
            assert dependencies <= used, f"{relative} no longer touches {dependencies - used}"

    def test_the_walk_finds_what_the_hooks_touch(self) -> None:
        """The scanner is not blind: it sees each private part the hooks module reaches."""
        names = {name for _, name, _ in touches(HOOKS)}
        assert {
            "_on_confirm_frame",
            "_on_return_frame",
            "_on_close_frame",
            "_on_deliver_frame",
            "_get_frame",
            "_Channel__get_content_header",
            "_read_content",
            "_reader_task",
            "_Connection__reader",
        } <= names

    @pytest.mark.parametrize(
        ("source", "name"),
        [
            ("channel._on_confirm_frame = handler", "_on_confirm_frame"),
            ("getattr(connection, '_reader_task', None)", "_reader_task"),
            ("from aiormq.channel import _check_routing_key", "_check_routing_key"),
            ("child._buckets[0].get()", "_buckets"),
        ],
    )
    def test_each_kind_of_touch_is_seen(self, tmp_path: Path, source: str, name: str) -> None:
        path = tmp_path / "module.py"
        path.write_text(source + "\n")
        assert name in {found for _, found, _ in touches(path)}

    def test_our_own_objects_are_ours(self, tmp_path: Path) -> None:
        """``self._buckets`` is this class's own attribute, whatever prometheus_client names."""
        path = tmp_path / "module.py"
        path.write_text("self._buckets = []\ncls._reader_task = None\n")
        assert touches(path) == []


class TestImports:
    def test_the_import_contracts_hold(self) -> None:
        """``lint-imports``: only the seam imports aiormq, pamqp or aio-pika (and whatever
        other contract pyproject.toml lists)."""
        lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
        assert lint is not None, "import-linter is not installed (the dev extra has it)"
        run = subprocess.run(
            [lint], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "broken" in run.stdout and " 0 broken" in run.stdout
