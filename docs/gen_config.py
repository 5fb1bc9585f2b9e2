"""mkdocs hook: tables generated from the code, so the docs never drift from it.

Listed under ``hooks:`` in ``mkdocs.yml``. A page that contains one of these
markers gets it replaced at build time:

``<!-- reliable_mq:config -->``
    every settings class in `reliable_mq.settings`: environment variable,
    type, default, constraints and description of each field.
``<!-- reliable_mq:metrics -->``
    every collector of `reliable_mq.metrics.Metrics`: exposed name, type,
    labels and meaning.
``<!-- reliable_mq:exports -->``
    the names ``reliable_mq`` exports and the module each is defined in.
``<!-- reliable_mq:api MODULE -->``
    one ``::: MODULE.NAME`` block per name in ``MODULE.__all__``: the API
    page shows the public objects, not the module docstring (which is about
    internals; those are on the "How it works" page).

Run it directly (``python docs/gen_config.py``) to print the three tables.
"""

from __future__ import annotations

import enum
import html
import importlib
import inspect
import re
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

_MARKER = re.compile(r"<!--\s*reliable_mq:(\w+)(?:\s+([\w.]+))?\s*-->")
_PASSWORD = re.compile(r"(://[^:/@]*:)[^@]*@")

_CONSTRAINTS = {
    "ge": "≥ {}",
    "gt": "> {}",
    "le": "≤ {}",
    "lt": "< {}",
    "min_length": "length ≥ {}",
    "max_length": "length ≤ {}",
}


def _markdown(text: str) -> str:
    """Double backticks from docstrings as single ones (Markdown code)."""
    return text.replace("``", "`")


def _escape(text: str) -> str:
    return _markdown(text).replace("|", "\\|").replace("\n", " ")


def _type_name(annotation: Any) -> str:
    if annotation is None or annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(
            _type_name(arg) for arg in typing.get_args(annotation)
        )
    if origin is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{_type_name(args[0])}, ...]"
        return f"tuple[{', '.join(_type_name(a) for a in args)}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "*required*"
    value = field.default
    if isinstance(value, SecretStr):
        return _code(_PASSWORD.sub(r"\1***@", value.get_secret_value()))
    if isinstance(value, tuple):
        items = (
            f"{item:g}" if isinstance(item, float) else str(item)
            for item in value
        )
        return _code(", ".join(items))
    if isinstance(value, enum.Enum):
        return _code(repr(value.value))
    return _code(repr(value))


def _constraints(field: FieldInfo) -> list[str]:
    found: list[str] = []
    for item in field.metadata:
        for attr, template in _CONSTRAINTS.items():
            value = getattr(item, attr, None)
            if value is not None:
                found.append(template.format(value))
    return found


def _settings_classes() -> list[type[BaseSettings]]:
    settings = importlib.import_module("reliable_mq.settings")
    classes = []
    for name in settings.__all__:
        obj = getattr(settings, name)
        if inspect.isclass(obj) and issubclass(obj, BaseSettings):
            classes.append(obj)
    return classes


def config_tables() -> str:
    """One section per settings class, one row per field."""
    out: list[str] = []
    for cls in _settings_classes():
        prefix = str(cls.model_config.get("env_prefix", ""))
        doc = inspect.getdoc(cls) or ""
        summary = doc.split("\n\n", 1)[0].replace("\n", " ")
        out.append(f"## `{cls.__name__}`\n")
        out.append(f"{_markdown(summary)}\n")
        out.append(
            f"Environment prefix: `{prefix}`. Class: [`{cls.__module__}.{cls.__name__}`][{cls.__module__}.{cls.__name__}].\n"
        )
        out.append(
            "| Field and environment variable | Type and default | Meaning |"
        )
        out.append("|---|---|---|")
        for name, field in cls.model_fields.items():
            meaning = [*_constraints(field)]
            if field.description:
                meaning.append(field.description)
            annotation = field.annotation
            env = _code(f"{prefix}{name.upper()}")
            if (
                inspect.isclass(annotation)
                and issubclass(annotation, BaseSettings)
            ) or any(
                inspect.isclass(arg) and issubclass(arg, BaseSettings)
                for arg in typing.get_args(annotation)
            ):
                meaning.append(
                    "a JSON object in the variable; its own variables fill the rest"
                )
            # Three columns, each value on its own line: the meaning gets the room.
            setting = f"{_code(name)}<br>{env}"
            kind = f"{_code(_type_name(annotation))}<br>default {_default(field)}"
            out.append(
                f"| {setting} | {kind} | {_escape('; '.join(meaning)) or '—'} |"
            )
        out.append("")
    return "\n".join(out)


_BREAK_AFTER = re.compile(r"(_|//|(?<!/)/(?!/)|,|&#124;)")


def _code(text: str, kind: str = "") -> str:
    """``text`` as HTML code for a table cell, wrapping only where a reader expects it.

    The site's CSS keeps table code on one line unless it contains a ``<wbr>``;
    this adds one after each underscore, slash, comma and ``|``, so a long
    variable name, type or URL wraps there (and at spaces), never mid-word.
    ``|`` is an entity (a bare one would end the Markdown table cell) and
    ``*`` one too (Markdown would read emphasis in ``guest:***@``).
    """
    escaped = html.escape(text, quote=False).replace("|", "&#124;")
    escaped = escaped.replace("*", "&#42;")
    tag = f'<code class="{kind}">' if kind else "<code>"
    return tag + _BREAK_AFTER.sub(r"\1<wbr>", escaped) + "</code>"


def metrics_table() -> str:
    """Every metric, as Prometheus exposes it."""
    metrics_module = importlib.import_module("reliable_mq.metrics")
    metrics = metrics_module.Metrics.describe()
    rows = [
        "| Metric | Type | Labels | Meaning | `Metrics` field |",
        "|---|---|---|---|---|",
    ]
    for field_name, spec in metrics.specs().items():
        kind: str = spec.kind.value
        exposed = {
            "counter": _code(f"{spec.name}_total", "metric"),
            "histogram": _code(f"{spec.name}_bucket", "metric")
            + " / `_sum` / `_count`",
        }.get(kind, _code(spec.name, "metric"))
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "—"
        rows.append(
            f"| {exposed} | {kind} | {labels} | {_escape(spec.documentation)} | {_code(field_name)} |"
        )
    return "\n".join(rows) + "\n"


def _documented_modules() -> set[str]:
    """Modules rendered by a ``::: module`` line or an api marker under docs/reference/."""
    found: set[str] = set()
    for page in (Path(__file__).parent / "reference").glob("*.md"):
        text = page.read_text()
        found.update(re.findall(r"^:::\s+([\w.]+)\s*$", text, re.MULTILINE))
        found.update(
            re.findall(r"<!--\s*reliable_mq:api\s+([\w.]+)\s*-->", text)
        )
    return found


def api_blocks(module_name: str) -> str:
    """``::: module.Name`` for every public name of ``module_name``, in ``__all__`` order."""
    module = importlib.import_module(module_name)
    documented = _documented_modules() - {module_name}
    names = [
        name
        for name in getattr(module, "__all__", ())
        # a re-export is documented where it is defined, if that page exists
        if getattr(getattr(module, name), "__module__", None)
        not in documented
    ]
    if not names:
        raise ValueError(f"{module_name} has no __all__ to document")
    return "\n\n".join(f"::: {module_name}.{name}" for name in names) + "\n"


def exports_table() -> str:
    """The package's public names and where each is defined (linked when documented)."""
    package = importlib.import_module("reliable_mq")
    documented = _documented_modules()
    rows = ["| Name | Kind | Defined in |", "|---|---|---|"]
    for name in package.__all__:
        obj = getattr(package, name)
        if name == "__version__":
            rows.append(f"| `__version__` | str | `{obj}` |")
            continue
        module = getattr(obj, "__module__", "reliable_mq")
        kind = (
            "exception"
            if inspect.isclass(obj) and issubclass(obj, BaseException)
            else ("class" if inspect.isclass(obj) else "function")
        )
        label = (
            f"[`{name}`][{module}.{name}]"
            if module in documented
            else f"`{name}`"
        )
        rows.append(f"| {label} | {kind} | `{module}` |")
    return "\n".join(rows) + "\n"


_GENERATORS = {
    "config": config_tables,
    "metrics": metrics_table,
    "exports": exports_table,
}


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs event: replace each marker by its generated table."""

    def replace(match: re.Match[str]) -> str:
        kind, argument = match.group(1), match.group(2)
        if kind == "api" and argument:
            return api_blocks(argument)
        generator = _GENERATORS.get(kind)
        if generator is None or argument:
            raise ValueError(f"unknown docs marker {match.group(0)}")
        return generator()

    return _MARKER.sub(replace, markdown)


_TABLE_CELL = re.compile(r"<td\b[^>]*>.*?</td>", re.S)
_LONG_PLAIN_CODE = re.compile(r"<code>([^<]{16,})</code>")
_BREAK_AFTER_HTML = re.compile(r"(_|//|(?<!/)/(?!/)|,|\|)")


def break_table_code(html_text: str) -> str:
    """Break points in the long plain ``<code>`` of every table cell of a page.

    Hand-written tables (and the API pages' parameter tables) have long
    identifiers too (``returns_retried_after_reconnect``): each gets a
    ``<wbr>`` after its underscores, slashes, commas and bars, as the
    generated tables do, so it can wrap there and nowhere else.
    """

    def cell(match: re.Match[str]) -> str:
        return _LONG_PLAIN_CODE.sub(
            lambda code: (
                "<code>"
                + _BREAK_AFTER_HTML.sub(r"\1<wbr>", code.group(1))
                + "</code>"
            ),
            match.group(0),
        )

    return _TABLE_CELL.sub(cell, html_text)


def on_page_content(html: str, **kwargs: Any) -> str:
    """mkdocs event: let long code in table cells wrap (see `break_table_code`)."""
    return break_table_code(html)


if __name__ == "__main__":
    import sys

    sys.stdout.write(
        "\n".join((config_tables(), metrics_table(), exports_table()))
    )
