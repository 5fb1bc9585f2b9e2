"""The docs stay in step with the code: generated tables, the dashboard, the site build."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from reliable_mq.metrics import Metrics
from reliable_mq.settings import ConnectionSettings, PublisherSettings, TLSSettings

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "reliable_mq.json"


def _load_hook() -> object:
    spec = importlib.util.spec_from_file_location("gen_config", ROOT / "docs" / "gen_config.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exposed_names() -> dict[str, str]:
    """Every sample-family name Prometheus shows, mapped to its Metrics field."""
    return {
        sample: field
        for field, spec in Metrics.describe().specs().items()
        for sample in spec.samples
    }


class TestGeneratedTables:
    def test_config_table_lists_every_field_with_its_variable(self) -> None:
        """Each settings field appears with its environment variable."""
        text = _load_hook().config_tables()  # type: ignore[attr-defined]
        plain = text.replace("<wbr>", "")
        for cls in (ConnectionSettings, PublisherSettings, TLSSettings):
            prefix = cls.model_config["env_prefix"]
            for name in cls.model_fields:
                assert f"<code>{prefix}{name.upper()}</code>" in plain, name
        assert "guest:guest" not in text  # the default URL's password is redacted

    def test_table_code_wraps_only_at_separators(self) -> None:
        """Long names, types and URLs get break points after _ / , and |; bars are entities."""
        code = _load_hook()._code  # type: ignore[attr-defined]
        assert code("RELIABLE_MQ_URL") == "<code>RELIABLE_<wbr>MQ_<wbr>URL</code>"
        assert code("str | None") == "<code>str &#124;<wbr> None</code>"
        assert code("amqp://a:***@h:5672/") == (
            "<code>amqp://<wbr>a:&#42;&#42;&#42;@h:5672/<wbr></code>"
        )
        assert code("float") == "<code>float</code>"  # nothing to break: stays on one line
        table = _load_hook().config_tables()  # type: ignore[attr-defined]
        rows = [line for line in table.splitlines() if line.startswith("| <code>")]
        assert rows and all(line.count(" | ") == 2 for line in rows)  # no stray cell breaks
        assert "\\|" not in table  # a backslashed bar shows literally inside code

    def test_long_code_in_hand_written_tables_gets_break_points(self) -> None:
        """Long plain code in any table cell can wrap at separators; short code is left."""
        fix = _load_hook().break_table_code  # type: ignore[attr-defined]
        html = (
            "<p><code>returns_retried_after_reconnect</code></p><table><tr>"
            "<td><code>returns_retried_after_reconnect</code> and <code>max_attempts</code>"
            '</td><td><code>str | None</code><code><a href="x">Linked</a>_y</code></td>'
            "</tr></table>"
        )
        fixed = fix(html)
        assert "<td><code>returns_<wbr>retried_<wbr>after_<wbr>reconnect</code>" in fixed
        assert "<p><code>returns_retried_after_reconnect</code></p>" in fixed  # prose
        assert "<code>max_attempts</code>" in fixed  # short: one piece
        assert '<code><a href="x">Linked</a>_y</code>' in fixed  # markup left alone

    def test_metrics_table_lists_every_collector(self) -> None:
        """Each Metrics field has a row in the metrics page."""
        text = _load_hook().metrics_table()  # type: ignore[attr-defined]
        for field in Metrics.describe().specs():
            assert f"| <code>{field.replace('_', '_<wbr>')}</code> |" in text, field

    def test_markers_are_replaced(self) -> None:
        """The mkdocs hook replaces markers and refuses unknown ones."""
        hook = _load_hook()
        out = hook.on_page_markdown("a\n<!-- reliable_mq:metrics -->\nb")  # type: ignore[attr-defined]
        assert (
            "reliable_<wbr>mq_<wbr>confirm_<wbr>latency_<wbr>seconds" in out and "<!--" not in out
        )
        with pytest.raises(ValueError, match="unknown docs marker"):
            hook.on_page_markdown("<!-- reliable_mq:nope -->")  # type: ignore[attr-defined]


class TestDashboard:
    def test_queries_use_only_real_metric_names(self) -> None:
        """Every reliable_mq_* name in the dashboard exists, and every collector is charted."""
        dashboard = json.loads(DASHBOARD.read_text())
        exprs = [
            target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
        ]
        used = set(re.findall(r"reliable_mq_\w+", " ".join(exprs)))
        exposed = _exposed_names()
        assert used, "no queries found"
        assert used <= set(exposed), used - set(exposed)
        assert {exposed[name] for name in used} == set(exposed.values())

    def test_panel_ids_are_unique(self) -> None:
        dashboard = json.loads(DASHBOARD.read_text())
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(ids) == len(set(ids))


_ROLE_NAMES = r":(?:py:)?(?:class|meth|func|attr|data|mod|exc|obj|const|ref|doc):"
_ROLE = re.compile(_ROLE_NAMES + "`")
_RENDERED_ROLE = re.compile(_ROLE_NAMES + r"(?:`|<code\b)")
"""A raw role in HTML: Markdown turns ``:class:`X` `` into ``:class:<code>X</code>``."""
_LITERAL_BLOCK = re.compile(r"[^:\s]::\s*$")  # reST "text::" before an indented block


def test_no_rest_roles_in_the_package() -> None:
    """Docstrings cross-reference in Markdown (`[Name][reliable_mq.x.Name]`) or backticks.

    mkdocstrings reads Google-style Markdown docstrings: a reST role such as
    ``:class:`X` `` or a ``text::`` literal-block marker would show up raw on
    the API pages (use a fenced code block instead).
    """
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "reliable_mq").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _ROLE.search(line) or _LITERAL_BLOCK.search(line)
    ]
    assert not found, "reST roles or literal blocks in docstrings:\n" + "\n".join(found)


def test_rendered_role_check_can_fail() -> None:
    """A role rendered the way the site renders Markdown is caught; plain code is not."""
    markdown = pytest.importorskip("markdown")
    extensions = ["admonition", "attr_list", "tables", "pymdownx.inlinehilite"]
    html = markdown.markdown(
        "Raises :class:`~reliable_mq.errors.PublishGaveUp` or :exc:`ValueError`.",
        extensions=extensions,
    )
    assert ":class:<code>" in html and not _ROLE.search(html)  # the old check saw nothing
    assert len(_RENDERED_ROLE.findall(html)) == 2
    clean = markdown.markdown("Raises `PublishGaveUp`; see `a:b` and `key: value`.")
    assert not _RENDERED_ROLE.search(clean)


_BY_NAME = re.compile(r"pip3?\s+install\s+(?:-[-\w]+\s+)*['\"]?reliable[-_]mq(?![-\w.])")
"""``pip install reliable-mq`` or ``pip install 'reliable-mq[spark]'``: not a wheel's name."""


def test_no_install_from_the_index() -> None:
    """No page, docstring, hint or example tells to install reliable_mq by name.

    No release is on the package index: installs go from a clone
    (``pip install '.[spark]'``) or from a built wheel
    (``pip install 'reliable_mq-0.1.0-py3-none-any.whl[spark]'``).
    """
    assert _BY_NAME.search("pip install 'reliable-mq[spark]'")
    assert _BY_NAME.search("pip install -U reliable_mq")
    assert not _BY_NAME.search("pip install 'reliable_mq-0.1.0-py3-none-any.whl[spark]'")
    assert not _BY_NAME.search("pip install '.[spark]'")
    paths = [ROOT / "README.md"]
    for folder in ("docs", "reliable_mq", "examples"):
        paths += [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in (".md", ".py")]
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0)!r}"
        for path in paths
        for match in _BY_NAME.finditer(path.read_text())
    ]
    assert not found, "install by name, but no release is on the index:\n" + "\n".join(found)


def test_no_paths_of_one_machine() -> None:
    """Pages and examples show generic paths, not a developer's checkout (``/work/main``)."""
    paths = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("*.py")]
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in paths
        for match in re.finditer(r"(?<![\w.])/(?:work|home|root)/\S*", path.read_text())
    ]
    assert not found, "\n".join(found)


def _private_modules() -> set[str]:
    """Every private module of the package, as a path under reliable_mq/ (``sync/_feed.py``)."""
    package = ROOT / "reliable_mq"
    return {
        str(path.relative_to(package))
        for path in package.rglob("_*.py")
        if path.name not in ("__init__.py", "__main__.py")
    }


def test_how_it_works_names_every_private_module_and_no_other() -> None:
    """The internals page names real modules (none deleted since) and explains all of them.

    A top-level module is named as `` `_acks.py` ``; one of a subpackage as
    `` `_feed.py` `` in that package's entry (``**`sync/`**``).
    """
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    existing = _private_modules()
    named = set(re.findall(r"(?<![\w/.])(_[a-z_]+\.py)\b", text))  # the diagram's too
    top_level = {name for name in existing if "/" not in name}
    for package, entry in re.findall(
        r"^- \*\*`([a-z]+)/`\*\*(.*?)(?=^- \*\*|^## )", text, re.M | re.S
    ):
        names = set(re.findall(r"`(_[a-z_]+\.py)`", entry))
        missing = {n for n in existing if n.startswith(package + "/")} - {
            f"{package}/{n}" for n in names
        }
        assert not missing, f"how-it-works.md does not explain {sorted(missing)}"
        stale = {f"{package}/{n}" for n in names} - existing
        assert not stale, f"how-it-works.md names modules that do not exist: {sorted(stale)}"
    subpackages = {name.split("/")[0] for name in existing if "/" in name}
    assert subpackages <= set(re.findall(r"^- \*\*`([a-z]+)/`\*\*", text, re.M)), subpackages
    everywhere = {name.rsplit("/", 1)[-1] for name in existing}
    assert named <= everywhere, f"stale module names: {sorted(named - everywhere)}"
    table = set(re.findall(r"^\| `(_[a-z_]+\.py)` \|", text, re.M))
    assert table == top_level, (sorted(top_level - table), sorted(table - top_level))


def test_docs_name_only_real_private_modules() -> None:
    """Every ``reliable_mq._name`` a page mentions exists (the deleted _confirm_channel did not)."""
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    for path in pages:
        for dotted in re.findall(
            r"\breliable_mq((?:\.[a-z_]+)*\._[a-z][a-z_]*)\b", path.read_text()
        ):
            module = ROOT / "reliable_mq" / dotted.strip(".").replace(".", "/")
            assert module.with_suffix(".py").exists() or module.is_dir(), f"{path}: {dotted}"


CODE_COLUMNS = 78
"""Columns of a code block that fit the site's content column at 1280 px (docs/ruff.toml)."""


def test_code_blocks_fit_the_page() -> None:
    """No line of a code block on the site is wider than the content column.

    With both sidebars shown (a 1280 px window) a wider line is cut off
    behind a scroll bar. ruff formats the Python blocks at this width
    (``docs/ruff.toml``); comments, shell and text blocks are wrapped by hand.
    """
    too_wide = []
    for path in sorted((ROOT / "docs").rglob("*.md")):
        fence: str | None = None
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fence = None if fence is not None else line[: len(line) - len(line.lstrip())]
                continue
            if fence is not None and len(line.removeprefix(fence)) > CODE_COLUMNS:
                too_wide.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:60]}")
    assert not too_wide, f"code lines over {CODE_COLUMNS} columns:\n" + "\n".join(too_wide)
    assert f"line-length = {CODE_COLUMNS}" in (ROOT / "docs" / "ruff.toml").read_text()


def test_site_builds_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict`` passes, and the built site is clean.

    No raw reST role on any page, no Python script copied into the site, the
    internals on "How it works" (not in the API pages), and metric names that
    can wrap only after an underscore.
    """
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stderr[-5000:]
    assert not list(site.rglob("*.py")), "scripts copied into the site"
    assert not (site / "ruff.toml").exists(), "tool configuration copied into the site"
    pages = {path: path.read_text() for path in site.rglob("*.html")}
    raw = [str(path) for path, html in pages.items() if _RENDERED_ROLE.search(html)]
    assert not raw, f"raw reST roles on {raw}"
    consumer_api = (site / "reference" / "consumer" / "index.html").read_text()
    assert "ReliableConsumer" in consumer_api
    assert "AckTracker" not in consumer_api  # internals live on the How it works page
    assert "_consume/acks.py" in (site / "how-it-works" / "index.html").read_text()
    metrics_page = (site / "guides" / "metrics" / "index.html").read_text()
    assert "reliable_<wbr>mq_<wbr>confirmed_<wbr>messages_<wbr>total" in metrics_page


def _load_renderer() -> Any:
    spec = importlib.util.spec_from_file_location(
        "render_panels", ROOT / "docs" / "render_panels.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["render_panels"] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


class TestRenderedPanels:
    """docs/render_panels.py's small PromQL, against real collectors (no broker)."""

    def test_histogram_quantile_interpolates_like_prometheus(self) -> None:
        render = _load_renderer()
        buckets = {0.1: 10.0, 0.5: 30.0, 1.0: 40.0, float("inf"): 40.0}
        assert render.histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 0.5)
        assert render.histogram_quantile(0.25, buckets) == pytest.approx(0.1)
        assert render.histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * 0.96)
        assert render.histogram_quantile(0.5, {float("inf"): 0.0}) != 0.5  # nan: no data

    def test_every_rendered_panel_query_evaluates(self) -> None:
        render = _load_renderer()
        registry = CollectorRegistry()
        metrics = Metrics.on(registry)
        exchange = metrics.for_publisher("p").for_exchange("")
        queue = metrics.for_queue("q")
        times, samples = [], []
        for second in range(5):
            exchange.published += 100
            queue.acked += 40
            queue.retried += 2
            queue.dead_letter_reason("rejected")
            exchange.latency.observe(0.004)
            times.append(float(second))
            samples.append(render.snapshot(registry))
        evaluator = render.Evaluator(times, samples)
        dashboard = json.loads(DASHBOARD.read_text())
        panels = {p["title"]: p for p in dashboard["panels"] if p.get("targets")}
        for title in render.PANELS:
            for target in panels[title]["targets"]:
                evaluator.evaluate(target["expr"], 4)  # raises on an unknown shape
        rate = 'sum(rate(reliable_mq_published_messages_total{job=~"$job"}[$__rate_interval]))'
        assert evaluator.evaluate(rate, 4) == {(): pytest.approx(100.0)}
        outcomes = panels["Consumer outcomes"]["targets"][0]["expr"]
        values = evaluator.evaluate(outcomes, 4)
        assert values[(("outcome", "acked"),)] == pytest.approx(40.0)
        assert values[(("outcome", "retried"),)] == pytest.approx(2.0)
        p50 = panels["Confirm latency"]["targets"][0]["expr"]
        assert 0.0025 <= evaluator.evaluate(p50, 4)[()] <= 0.005
        assert render.legend_for("{{queue}} {{reason}}", {"queue": "q", "reason": "x"}) == "q x"

    def test_metrics_guide_shows_the_rendered_panels(self) -> None:
        guide = (ROOT / "docs" / "guides" / "metrics.md").read_text()
        assert "../img/dashboard.png" in guide
        assert (ROOT / "docs" / "img" / "dashboard.png").stat().st_size > 10_000
