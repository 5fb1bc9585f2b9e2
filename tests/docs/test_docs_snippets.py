"""The docs are code: every ```python block of README.md and docs/ runs as written.

Each page's blocks run in page order, each as its own script in a fresh
process (``python block.py``, the page's own temporary folder as the working
directory, a timeout), against the shared broker. Every page gets a fresh
virtual host of its own, so a page starts on an empty broker and parallel runs
cannot meet: the harness rewrites the vhost of each ``...@127.0.0.1:5672/`` URL
in a block (and sets ``RELIABLE_MQ_URL``) to that page's vhost. That is the
only change made to a block.

A block may be preceded, on the line right before its fence, by a marker:

``<!-- docs-test: skip -->``
    a block that cannot run here (it needs Spark, a web framework or a
    database server that is not the test's). It is still compiled (top-level
    ``await`` allowed), and like every block it must be self-contained: ruff's
    pyflakes rules find no undefined name and no unused import in it.
``<!-- docs-test: interrupt-after-lines N -->``
    a long-running block (a consumer's ``run()``): once it has printed N
    lines on stdout it gets SIGINT, as Ctrl-C would send, and must then exit 0.
``<!-- docs-test: interrupt-when-consuming QUEUE -->``
    a long-running block that may get no message: once QUEUE (in the page's
    vhost) has a consumer, the block gets SIGINT and must then exit 0. This
    proves it declared its queues, started consuming and shuts down cleanly.
``<!-- docs-test: file NAME -->``
    not run: written to NAME in the page's folder for the blocks after it
    (a ``conftest.py``, a module they import).
``<!-- docs-test: pytest -->``
    a test module, run with ``python -m pytest -o asyncio_mode=auto``; it
    must pass.

Any other marker fails the test (a typo must not skip a block silently).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.support.amqp import run_sync, wait_for_amqp

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
BLOCK_TIMEOUT = 90.0
"""Seconds one block may run (generous: a loaded 2-core machine imports slowly)."""

_FENCE = re.compile(r"^(\s*)```+\s*(\w*)")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*([\w-]+)\s*(.*?)\s*-->\s*$")
_LOCAL_URL = re.compile(r"(amqps?://[^\s\"'/]*127\.0\.0\.1:5672)/(?=[\"'])")
_KINDS = {"run", "skip", "interrupt-after-lines", "interrupt-when-consuming", "file", "pytest"}
_LONG_RUNNING = ("interrupt-after-lines", "interrupt-when-consuming")


@dataclass(frozen=True)
class Block:
    """One fenced python block of a page."""

    page: str
    line: int
    source: str
    kind: str = "run"
    argument: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass
class Outcome:
    """What one block did."""

    block: Block
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None


@dataclass
class Page:
    path: str
    blocks: list[Block] = field(default_factory=list)

    @property
    def runnable(self) -> bool:
        return any(block.kind in ("run", *_LONG_RUNNING, "pytest") for block in self.blocks)


def _pages() -> list[Page]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [Page(str(path.relative_to(ROOT)), list(_blocks(path))) for path in paths]


def _fences(path: Path) -> Iterator[tuple[str, int, list[str], str]]:
    """Each fenced block: its language, the line of its fence, its lines, the line before."""
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        indent, language = fence.groups()
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        body = [line.removeprefix(indent) for line in lines[index + 1 : end]]
        yield language, index + 1, body, lines[index - 1] if index else ""
        index = end + 1


def _blocks(path: Path) -> Iterator[Block]:
    page = str(path.relative_to(ROOT))
    for language, line, body, before in _fences(path):
        if language in ("python", "py"):
            marker = _MARKER.match(before)
            kind, argument = (marker.group(1), marker.group(2)) if marker else ("run", "")
            yield Block(page, line, "\n".join(body) + "\n", kind, argument)


PAGES = [page for page in _pages() if page.blocks]


def test_markers_are_known() -> None:
    """Every docs-test marker is one of the documented kinds, with a valid argument."""
    for page in PAGES:
        for block in page.blocks:
            assert block.kind in _KINDS, f"{block.where}: unknown marker {block.kind!r}"
            if block.kind == "interrupt-after-lines":
                assert block.argument.isdigit(), f"{block.where}: needs a line count"
            if block.kind == "file":
                assert re.fullmatch(r"[\w.]+\.py", block.argument), f"{block.where}: file name"
    text = (ROOT / "docs" / "guides" / "testing-your-app.md").read_text()
    assert "docs-test" not in text or "docs-test: pytest" in text  # used, so documented


@pytest.mark.parametrize(
    "block",
    [block for page in PAGES for block in page.blocks if block.kind == "skip"],
    ids=lambda block: block.where,
)
def test_fragments_compile(block: Block) -> None:
    """A fragment is not run, but it must still be valid Python."""
    try:
        compile(block.source, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        pytest.fail(f"{block.where}: {exc}")


_NAME_RULES = "F821,F401,F811,F841"
"""pyflakes rules every block must pass: undefined, unused or redefined names."""


def _ruff_findings(sources: dict[str, str]) -> dict[str, list[str]]:
    """Run ruff's pyflakes rules over each source; findings by key (one ruff process)."""
    folder = Path(tempfile.mkdtemp(prefix="docs-blocks-"))
    try:
        names = {f"block_{n}.py": key for n, key in enumerate(sources)}
        for name, key in names.items():
            (folder / name).write_text(sources[key])
        done = subprocess.run(
            [sys.executable, "-m", "ruff", "check", "--isolated", "--select", _NAME_RULES,
             "--output-format", "json", "--no-cache", "--exit-zero", str(folder)],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        findings: dict[str, list[str]] = {key: [] for key in sources}
        for item in json.loads(done.stdout):
            key = names[Path(item["filename"]).name]
            line = item["location"]["row"]
            findings[key].append(f"line {line}: {item['code']} {item['message']}")
        return findings
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_every_block_defines_what_it_uses() -> None:
    """No block (run or skipped) uses a name it does not define or import.

    A skipped block is never run, and the body of a handler a block only
    registers never runs either: a NameError there would reach the reader,
    not the test. Blocks written to a file for the next ones (``file``) and
    test modules (``pytest``, whose fixtures are parameters) are checked too.
    """
    blocks = {block.where: block.source for page in PAGES for block in page.blocks}
    findings = _ruff_findings(blocks)
    bad = {where: found for where, found in findings.items() if found}
    assert not bad, "\n".join(f"{where}: {'; '.join(found)}" for where, found in bad.items())


def test_name_check_catches_an_undefined_name() -> None:
    """The check above can fail: the original getting-started bug is caught."""
    findings = _ruff_findings(
        {
            "bad": "from reliable_mq import ReliableConsumer\n\n"
            "consumer = ReliableConsumer(url)\n\n\n"
            "@consumer.handler('orders')\nasync def on_order(order: Order) -> None:\n"
            "    ship(order)\n",
            "good": "import json\n\nprint(json.dumps(1))\n",
        }
    )
    assert len(findings["bad"]) == 3 and all("F821" in f for f in findings["bad"])
    assert findings["good"] == []


# -- command lines -----------------------------------------------------------------------

_SHELL_LANGUAGES = ("bash", "sh", "shell", "console", "")


def _command_lines() -> Iterator[tuple[str, list[str]]]:
    """Every ``reliable-mq ...`` command in a shell block of README.md and docs/.

    Continuation lines are joined, comments dropped, and pipelines and ``&&``
    lists split; a command may follow ``VAR=value`` assignments or a path
    (``ExecStart=/srv/app/.venv/bin/reliable-mq run ...``).
    """
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        page = str(path.relative_to(ROOT))
        for language, fence_line, lines, _ in _fences(path):
            if language == "yaml":
                yield from _yaml_commands(f"{page}:{fence_line}", yaml.safe_load("\n".join(lines)))
                continue
            body = lines
            if language == "ini":  # a systemd unit: only its Exec lines are commands
                body = [line if line.startswith("Exec") else "" for line in lines]
            elif language not in _SHELL_LANGUAGES:
                continue
            number = 0
            while number < len(body):
                first, line = number, body[number]
                while line.endswith("\\") and number + 1 < len(body):
                    number += 1
                    line = line[:-1] + " " + body[number]
                number += 1
                if "reliable-mq" in line:
                    yield from _commands_in(f"{page}:{fence_line + 1 + first}", line)


def _commands_in(where: str, line: str) -> Iterator[tuple[str, list[str]]]:
    """The arguments of each ``reliable-mq`` command of one shell line."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    segment: list[str] = []
    for token in [*lexer, ";"]:
        if token and set(token) <= set("|&;()<>"):  # an operator ends a command
            yield from _reliable_mq_args(where, segment)
            segment = []
        else:
            segment.append(token)


def _yaml_commands(where: str, node: object) -> Iterator[tuple[str, list[str]]]:
    """Each list of a YAML document that is a ``reliable-mq`` command (a container's args)."""
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, list):
        if node and node[0] == "reliable-mq":
            yield where, [str(word) for word in node[1:]]
            return
        for item in node:
            yield from _yaml_commands(where, item)


def _reliable_mq_args(where: str, words: list[str]) -> Iterator[tuple[str, list[str]]]:
    for position, word in enumerate(words):
        program = word.split("=", 1)[1] if "=" in word else word
        if program.rsplit("/", 1)[-1] == "reliable-mq":
            yield where, words[position + 1 :]
            return
        if "=" not in word:  # not an assignment: the command is something else
            return


COMMAND_LINES = list(_command_lines())


def test_command_lines_are_found() -> None:
    """The extractor sees the CLI guide's examples (so the next test checks something)."""
    pages = {where.rsplit(":", 1)[0] for where, _ in COMMAND_LINES}
    assert {"docs/guides/cli.md", "docs/deploy.md", "docs/outbox.md"} <= pages
    assert sum(where.startswith("docs/deploy.md") for where, _ in COMMAND_LINES) == 3
    assert len(COMMAND_LINES) >= 15


@pytest.mark.parametrize(("where", "args"), COMMAND_LINES, ids=[w for w, _ in COMMAND_LINES])
def test_command_lines_parse(
    where: str, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Every ``reliable-mq`` command shown in the docs is accepted by the CLI's parser.

    Only parsed (``build_parser().parse_args``), never run: a renamed option, a
    missing argument or a subcommand that does not exist fails here.
    """
    from reliable_mq.cli import build_parser

    try:
        _no_abbreviations(build_parser()).parse_args(args)
    except SystemExit as exc:
        if exc.code not in (0, None):  # --help and --version exit 0
            pytest.fail(f"{where}: reliable-mq {' '.join(args)}\n{capsys.readouterr().err}")


def _no_abbreviations(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser, and every sub-parser, refusing abbreviated options (``--work``)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _no_abbreviations(sub)
    return parser


def test_cli_guide_lists_every_subcommand() -> None:
    """The table at the top of the CLI guide names every subcommand with its help."""
    from reliable_mq.cli import COMMANDS

    text = (ROOT / "docs" / "guides" / "cli.md").read_text()
    for command in COMMANDS:
        row = f"| `reliable-mq {command.name}` | {command.help} |"
        assert row in text, command.name


# -- vhosts ------------------------------------------------------------------------------


def _rabbitmqctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    command = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}
    return subprocess.run(
        [command, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


@pytest.fixture(scope="module")
def vhosts(broker_url: str) -> Iterator[dict[str, str]]:
    """A fresh vhost per runnable page on the shared broker (one import, deleted after)."""
    if shutil.which("rabbitmqctl") is None and not Path("/usr/sbin/rabbitmqctl").exists():
        message = "rabbitmqctl is needed to give each docs page a fresh vhost"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    run_id = uuid.uuid4().hex[:8]
    names = {
        page.path: f"docs-{run_id}-{re.sub(r'[^a-z0-9]+', '-', page.path.lower())}"
        for page in PAGES
        if page.runnable
    }
    definitions = {
        "vhosts": [{"name": name} for name in names.values()],
        "permissions": [
            {"user": "guest", "vhost": name, "configure": ".*", "write": ".*", "read": ".*"}
            for name in names.values()
        ],
    }
    # Debian's rabbitmqctl runs as the rabbitmq user: the file must be readable to it.
    folder = Path(tempfile.mkdtemp(prefix="docs-vhosts-"))
    folder.chmod(0o755)
    path = folder / "definitions.json"
    path.write_text(json.dumps(definitions))
    path.chmod(0o644)
    try:
        done = _rabbitmqctl("import_definitions", str(path))
        assert done.returncode == 0, done.stdout + done.stderr
        base = broker_url.rstrip("/")
        for name in names.values():  # the import is asynchronous: wait for each vhost
            run_sync(lambda name=name: wait_for_amqp(f"{base}/{name}", timeout=60))
        yield {page: f"{base}/{name}" for page, name in names.items()}
    finally:
        deleting = [
            subprocess.Popen(
                [shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl", "delete_vhost", name],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for name in names.values()
        ]
        for process in deleting:
            process.wait(timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


# -- running blocks ---------------------------------------------------------------------


def _script(block: Block, url: str) -> str:
    vhost = url.rsplit("/", 1)[1]
    return _LOCAL_URL.sub(rf"\1/{vhost}", block.source)


def _env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_MQ_")}
    env["RELIABLE_MQ_URL"] = url
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run_block(block: Block, folder: Path, url: str) -> Outcome:
    script = folder / f"block_{block.line}.py"
    script.write_text(_script(block, url))
    if block.kind == "pytest":
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "-o", "asyncio_mode=auto", str(script)]  # fmt: skip
    else:
        command = [sys.executable, str(script)]
    process = subprocess.Popen(
        command,
        cwd=folder,
        env=_env(url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stderr is not None
    out: list[str] = []
    err: list[str] = []
    wanted = int(block.argument) if block.kind == "interrupt-after-lines" else None
    enough = threading.Event()
    if block.kind == "interrupt-when-consuming":
        watcher = threading.Thread(
            target=_set_when_consuming, args=(url, block.argument, enough, process), daemon=True
        )
        watcher.start()

    def read_out() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            out.append(line)
            if wanted is not None and len(out) >= wanted:
                enough.set()

    def read_err() -> None:
        assert process.stderr is not None
        err.extend(process.stderr)

    readers = [threading.Thread(target=read_out), threading.Thread(target=read_err)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + BLOCK_TIMEOUT
    try:
        if block.kind in _LONG_RUNNING:
            while not enough.wait(0.05):
                if process.poll() is not None or time.monotonic() > deadline:
                    break
            if enough.is_set():
                process.send_signal(signal.SIGINT)
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        err.append(f"\n[docs-test] killed after {BLOCK_TIMEOUT:.0f} s\n")
    for reader in readers:
        reader.join(timeout=10)
    outcome = Outcome(block, "".join(out), "".join(err), process.returncode)
    if block.kind in _LONG_RUNNING and not enough.is_set():
        outcome.returncode = outcome.returncode or -1
        outcome.stderr += f"\n[docs-test] never reached its stop condition ({block.kind} "
        outcome.stderr += f"{block.argument}; {len(out)} lines printed)\n"
    return outcome


def _set_when_consuming(
    url: str, queue: str, ready: threading.Event, process: subprocess.Popen[str]
) -> None:
    """Set ``ready`` once ``queue`` has a consumer (polled with passive declares)."""
    import aio_pika

    async def watch() -> None:
        connection = await aio_pika.connect(url)
        async with connection:
            while process.poll() is None:
                channel = await connection.channel()
                try:
                    declared = await channel.declare_queue(queue, passive=True)
                except aio_pika.exceptions.ChannelNotFoundEntity:
                    pass  # not declared yet
                else:
                    if declared.declaration_result.consumer_count:
                        ready.set()
                        return
                    await channel.close()
                await asyncio.sleep(0.1)

    run_sync(watch)


def run_page(page: Page, url: str, folder: Path) -> list[Outcome]:
    """Run (or write) the page's blocks in order; fail on the first that does not exit 0."""
    outcomes: list[Outcome] = []
    for block in page.blocks:
        if block.kind == "skip":
            continue
        if block.kind == "file":
            (folder / block.argument).write_text(_script(block, url))
            continue
        outcome = _run_block(block, folder, url)
        outcomes.append(outcome)
        if outcome.returncode != 0:
            pytest.fail(
                f"{block.where} ({block.kind}) exited {outcome.returncode}\n"
                f"--- stdout\n{outcome.stdout[-3000:]}\n--- stderr\n{outcome.stderr[-5000:]}"
            )
    return outcomes


STORY_PAGES = ("README.md", "docs/getting-started.md")


@pytest.mark.parametrize(
    "page",
    [page for page in PAGES if page.runnable and page.path not in STORY_PAGES],
    ids=lambda page: page.path,
)
def test_page_runs_as_written(page: Page, vhosts: dict[str, str], tmp_path: Path) -> None:
    """Every block of the page that is not a fragment runs and exits 0."""
    run_page(page, vhosts[page.path], tmp_path)


@pytest.mark.parametrize("path", STORY_PAGES)
def test_quick_starts_tell_one_story(path: str, vhosts: dict[str, str], tmp_path: Path) -> None:
    """On an empty broker, the consumer quick start handles exactly what the publisher sent.

    The publisher block declares the queue set and publishes orders 1..100;
    the consumer block prints one line per order it handled and is
    interrupted (Ctrl-C) after the 100th. Every order is handled once, none is
    retried or dead-lettered, and the queues are empty afterwards.
    """
    page = next(page for page in PAGES if page.path == path)
    outcomes = run_page(page, vhosts[path], tmp_path)
    consumer = next(o for o in outcomes if o.block.kind == "interrupt-after-lines")
    handled = re.findall(r"^order (\d+): [\d.]+ \(attempt (\d+)\)$", consumer.stdout, re.M)
    assert sorted(int(order) for order, _ in handled) == list(range(1, 101)), consumer.stdout
    assert {attempt for _, attempt in handled} == {"1"}
    assert _depths(vhosts[path], ("orders", "orders.dlq")) == {"orders": 0, "orders.dlq": 0}


def _depths(url: str, queues: tuple[str, ...]) -> dict[str, int]:
    import aio_pika

    async def depths() -> dict[str, int]:
        connection = await aio_pika.connect(url)
        async with connection:
            channel = await connection.channel()
            found = {}
            for name in queues:
                queue = await channel.declare_queue(name, passive=True)
                found[name] = int(queue.declaration_result.message_count or 0)
            return found

    return run_sync(depths)
