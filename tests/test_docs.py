"""The pages cannot rot: every code block of README.md and docs/*.md is run or checked, every
relative link resolves, and every source path and module the pages name exists.

- ```python blocks that start no process run in one test per page and tier, the page's blocks of
  that tier in order in one namespace, in a temporary directory, leaving no child process: plans,
  validate, estimates, the plan search and figures in the `pure` tier; dry runs on virtual meshes
  (torch's fake process group in this process, as tests/test_dryrun.py's) in the `rank1` tier;
- ```python blocks that need a live Session (they name `s` or `Session`, or are a `%%px` cell)
  run in ONE `session` test on one 4-rank session (conftest's `session4`): each page's blocks in
  order, in a namespace of their own, from tiny-llama under dp4 (where the README's tour leaves
  the reader). `Session(...)` in a block borrows that session (the same rank count and device)
  and leaves it running; a `%%px` cell's body runs on every rank through the session's view;
- ```bash blocks are not run but checked: each `./dev.sh` subcommand and its `--demo` exist in
  dev.sh's `case`, each `-m <tiers>` names declared markers, each `interactive-parallel` command
  line (and dev.sh's own demo line) parses with the CLI's own argparse and its `--plan` with
  `Plan.parse`, and each flag given to a `bench/` script appears in that script;
- ```text blocks are output: shown, not run;
- a block that cannot run here (a Slurm site, hosts, a GPU) is marked on the line before its
  fence with `<!-- not run: <why> -->`: counted (NOT_RUN) and refused without a reason.

Paths are checked so that a module moved or renamed shows up as a stale page: every
`interactive_parallel/...` path, its short forms (`runtime/families.py`, `plan/steptime.py`, ...),
every `bench/`, `tests/`, `notebooks/` and `binder/` path, and every dotted module reference
(`runtime.data.local_batch`, `interactive_parallel.cluster.netns`).

Knows nothing of what the pages say beyond their blocks, links and paths.
"""
from __future__ import annotations

import argparse
import ast
import re
import shlex
import time
import tomllib
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "interactive_parallel"
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LANGS = ("python", "bash", "text")
NOT_RUN = 2
"""Blocks marked `<!-- not run: ... -->`: attaching to a cluster across hosts and starting one with
a site's launcher (docs/scaling-out.md); tests/test_multihost.py and tests/test_launchers.py run
those on namespaced hosts. A new one is a decision: raise this with it."""
README_MAX_LINES = 250
"""The README is a guide; the reference lives in docs/."""

FENCE = re.compile(r"^```(\S*)\s*$")
NOT_RUN_MARK = re.compile(r"^<!--\s*not run:(.*?)-->$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # the first code line, 1-based
    lang: str
    code: str
    not_run: str | None  # the reason given, or None

    @property
    def px(self) -> bool:
        return self.lang == "python" and self.code.lstrip().startswith("%%px")

    @property
    def tier(self) -> str:
        """'session' (it names `s` or `Session`, or is a %%px cell), 'rank1' (a dry run: torch's fake
        process group in this process) or 'pure'."""
        if self.px:
            return "session"
        tree = ast.parse(self.code)
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        if "s" in names or "Session" in names:
            return "session"
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        return "rank1" if "dry_run" in names | attrs else "pure"

    def runs_in(self, tier: str) -> bool:
        return self.lang == "python" and self.not_run is None and self.tier == tier


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of `page`, in order. Fences open and close at the start of a line."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        assert end is not None, f"{rel(page)}:{i + 1}: a fence that never closes"
        mark = NOT_RUN_MARK.match(lines[i - 1].strip()) if i else None
        out.append(Block(rel(page), i + 2, m[1], "\n".join(lines[i + 1:end]), mark[1].strip() if mark else None))
        i = end + 1
    return out


def prose(page: Path) -> str:
    """`page` without its fenced blocks."""
    return re.sub(r"^```.*?^```[ \t]*$", "", page.read_text(), flags=re.S | re.M)


def run_block(block: Block, ns: dict) -> None:
    """Execute a python block; a traceback names the page and its line."""
    code = compile("\n" * (block.line - 1) + block.code, str(ROOT / block.page), "exec")
    exec(code, ns)


ALL = [b for page in PAGES for b in blocks(page)]


# ---------------------------------------------------------------- python blocks
# The session test comes first in this module: under xdist the module is one unit, scheduled by
# the tier of its first test, and the session test is its costliest (conftest._schedule).

class _Borrowed:
    """What `Session(...)` gives a docs block: the test's live session, asked for with its rank
    count and device; entered and left without stopping it."""

    def __init__(self, live, ranks: int = 4, device: str = "cpu", **options):
        assert (ranks, device) == (live.world_size, live.device), \
            f"a docs block asks for Session(ranks={ranks}, device={device!r}); the test's has " \
            f"{live.world_size} on {live.device}"
        self._live = live

    def __enter__(self):
        return self._live

    def __exit__(self, *exc) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._live, name)


def _run_px(session, block: Block) -> None:
    """A `%%px` cell: its body on every rank, in the namespace the session's engines give a cell."""
    body = block.code.split("\n", 1)[1]
    result = session.view.execute(body, block=True)
    result.get()  # a rank's exception raises here, naming the rank


@pytest.mark.session
def test_session_blocks_run_on_one_live_session(session4, tmp_path, monkeypatch):
    """Every page's blocks that need a session, page by page, on one 4-rank session."""
    import interactive_parallel.cluster as cluster
    from interactive_parallel import Plan

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cluster, "Session", partial(_Borrowed, session4))
    took = {}
    for page in PAGES:
        todo = [b for b in blocks(page) if b.runs_in("session")]
        if not todo:
            continue
        t0 = time.perf_counter()
        if session4.spec is not None:  # dp4 first, which any model takes (a plan with ep refuses tiny-llama)
            session4.apply(Plan(dp=4))
        session4.load_model("tiny-llama")  # where the tour leaves the reader, whatever the last page did
        session4.apply(Plan(dp=4))
        ns: dict = {"__name__": "__docs__", "s": session4}
        for block in todo:
            if block.px:
                _run_px(session4, block)
            else:
                run_block(block, ns)
        took[rel(page)] = round(time.perf_counter() - t0, 1)
    assert took, "no page has a block that needs a session"
    print("seconds per page:", took)


def _pages(tier: str) -> list[Path]:
    return [p for p in PAGES if any(b.runs_in(tier) for b in blocks(p))]


def _run_page(page: Path, tier: str) -> None:
    """The page's blocks of `tier`, in order, sharing one namespace; no child process may be left."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ns: dict = {"__name__": "__docs__"}
    for block in blocks(page):
        if block.runs_in(tier):
            run_block(block, ns)
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not started, f"{rel(page)}: a block without a session started {started}"


@pytest.mark.pure
@pytest.mark.parametrize("page", _pages("pure"), ids=rel)
def test_pure_blocks_run(page, tmp_path, monkeypatch):
    """Plans, validation, estimates, the plan search, figures: no process, no torch.distributed."""
    monkeypatch.chdir(tmp_path)
    _run_page(page, "pure")


@pytest.mark.rank1
@pytest.mark.parametrize("page", _pages("rank1"), ids=rel)
def test_dry_run_blocks_run(page, tmp_path, monkeypatch):
    """Dry runs on virtual meshes: torch's fake process group in this process, as
    tests/test_dryrun.py's are."""
    monkeypatch.chdir(tmp_path)
    _run_page(page, "rank1")


# ---------------------------------------------------------------- the blocks' shape (pure)

@pytest.mark.pure
def test_every_block_is_python_bash_or_text_and_parses():
    wrong = [f"{b.page}:{b.line} ```{b.lang}" for b in ALL if b.lang not in LANGS]
    assert not wrong, f"blocks of no known language (one of {LANGS}): {wrong}"
    for b in ALL:
        if b.lang == "python":
            ast.parse(b.code.split("\n", 1)[1] if b.px else b.code, f"{b.page}:{b.line}")
    indented = [f"{rel(p)}:{n}" for p in PAGES for n, line in enumerate(p.read_text().splitlines(), 1)
                if re.match(r"^\s+```", line)]
    assert not indented, f"indented fences are neither run nor checked: {indented}"


@pytest.mark.pure
def test_blocks_not_run_say_why_and_are_counted():
    marks = [(rel(p), n, line) for p in PAGES for n, line in enumerate(p.read_text().splitlines(), 1)
             if line.lstrip().startswith("<!-- not run")]
    skipped = [b for b in ALL if b.not_run is not None]
    assert len(marks) == len(skipped), f"a not-run mark not on the line before a fence: {marks}"
    assert all(b.not_run for b in skipped), [f"{b.page}:{b.line}" for b in skipped if not b.not_run]
    assert all(b.lang == "python" for b in skipped), "only python blocks are run, so only they are marked"
    assert len(skipped) == NOT_RUN, [f"{b.page}:{b.line}: {b.not_run}" for b in skipped]


# ---------------------------------------------------------------- shell blocks (checked, not run)

def _dev_sh() -> tuple[set[str], set[str], list[str]]:
    """dev.sh's subcommands (its case labels), the flags `start` reads itself, and its demo line."""
    text = (ROOT / "dev.sh").read_text()
    case = text[text.index('case "$cmd" in'):text.index("esac")]
    subs = set(re.findall(r"^  (\w+)\)", case, re.M))
    flags = set(re.findall(r'"\$\{1:-\}" = "(--[\w-]+)"', case))
    demo = re.search(r'interactive-parallel" (demo [^"\n]*?) "\$@"', text)
    assert subs and demo, "dev.sh's case or its demo line moved: read them again here"
    return subs, flags, shlex.split(demo[1])


def _markers() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {m.split(":")[0].strip() for m in config["tool"]["pytest"]["ini_options"]["markers"]}


class _Parsed(Exception):
    pass


def _cli_parses(argv: list[str], monkeypatch) -> argparse.Namespace:
    """`interactive-parallel argv` through the CLI's own parser, stopped before it acts."""
    from interactive_parallel import cli

    plain = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):
        raise _Parsed(plain(self, args, namespace))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop)
        try:
            cli.main(argv)
        except _Parsed as parsed:
            return parsed.args[0]
        except SystemExit as exc:
            raise AssertionError(f"interactive-parallel {shlex.join(argv)}: refused by the CLI (exit {exc.code})")
    raise AssertionError(f"interactive-parallel {shlex.join(argv)}: the CLI never parsed its arguments")


def _commands(code: str) -> list[list[str]]:
    """Each simple command of a shell block, its leading VAR=value words dropped."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        words, cmd = shlex.split(line, comments=True), []
        for w in words + [";"]:
            if w in (";", "&&", "||", "|"):
                while cmd and re.match(r"^\w+=", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


SHELL = [b for b in ALL if b.lang == "bash"]


@pytest.mark.pure
@pytest.mark.parametrize("block", SHELL, ids=[f"{b.page}:{b.line}" for b in SHELL])
def test_shell_blocks_name_commands_that_exist(block, monkeypatch):
    from interactive_parallel import Plan

    subs, start_flags, demo_line = _dev_sh()
    markers = _markers()
    for cmd in _commands(block.code):
        where = f"{block.page}:{block.line}: {shlex.join(cmd)}"
        if cmd[0] == "./dev.sh":
            sub = cmd[1] if len(cmd) > 1 else "start"
            assert sub in subs, f"{where}: dev.sh has no subcommand {sub!r} ({sorted(subs)})"
            args = cmd[2:]
            if sub == "start" and args:
                assert args[0] in start_flags, f"{where}: dev.sh start reads {sorted(start_flags)}"
                _cli_parses(demo_line + args[1:], monkeypatch)
            if sub == "test":
                for flag, value in zip(args, args[1:]):
                    if flag == "-m":
                        named = set(re.findall(r"\w+", value)) - {"and", "or", "not"}
                        assert named <= markers, f"{where}: no such marker {named - markers}"
        elif cmd[0] == "interactive-parallel":
            parsed = _cli_parses(cmd[1:], monkeypatch)
            if getattr(parsed, "plan", None):
                Plan.parse(parsed.plan)
        for word in cmd:
            if word.startswith("bench/") and word.endswith(".py"):
                script = ROOT / word
                assert script.is_file(), f"{where}: no {word}"
                flags = [w.split("=")[0] for w in cmd[cmd.index(word) + 1:] if w.startswith("--")]
                missing = [f for f in flags if f'"{f}"' not in script.read_text()]
                assert not missing, f"{where}: {word} reads no {missing}"


@pytest.mark.pure
def test_dev_sh_demo_line_parses(monkeypatch):
    """dev.sh's `start --demo` line is one the CLI takes (its defaults and dev.sh's agree)."""
    from interactive_parallel import Plan

    parsed = _cli_parses(_dev_sh()[2], monkeypatch)
    if parsed.plan is not None:  # None: dp over a rank per core (cli.py)
        Plan.parse(parsed.plan)


# ---------------------------------------------------------------- links, paths, modules (pure)

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, only letters, digits, spaces, - and _ kept,
    spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m[1]) for m in re.finditer(r"^#+ (.+)$", prose(page), re.M)}


@pytest.mark.pure
@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {rel(dest)})")
    assert not broken, f"{rel(page)}: {broken}"


SHORT = r"(?:runtime|plan|cluster|records|viz|widgets)/[\w/]*\w\.py"
PATHS = re.compile(rf"(?<![\w/.-])(?:(interactive_parallel/[\w./-]*\w)|({SHORT})|((?:configs|texts)/[\w.-]*\w)"
                   rf"|((?:bench|tests|notebooks|binder)/[\w./-]*\w))")


@pytest.mark.pure
@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_named_paths_exist(page):
    """Every source path the page names, in its prose and its blocks (short forms resolve under
    interactive_parallel/)."""
    missing = []
    for m in PATHS.finditer(page.read_text()):
        full, short, data, other = m.groups()
        path = ROOT / full if full else PKG / (short or data) if (short or data) else ROOT / other
        if not path.exists():
            missing.append(m[0])
    assert not missing, f"{rel(page)} names paths that do not exist: {sorted(set(missing))}"


DOTTED = re.compile(r"(?<![\w.])((?:interactive_parallel\.)?(?:runtime|plan|cluster|records|viz|widgets|lessons)"
                    r"(?:\.[A-Za-z_]\w*)+)")


def _defines(module: Path, name: str) -> bool:
    """`name` is in `module`'s text (a definition, an import or __all__): a renamed or moved name
    is not."""
    return re.search(rf"\b{re.escape(name)}\b", module.read_text()) is not None


def _resolves(dotted: str) -> bool:
    """`runtime.data.local_batch`: a module under interactive_parallel/, then a name it defines.
    A first step that is neither a module nor a name its package defines does not resolve."""
    parts = dotted.removeprefix("interactive_parallel.").split(".")
    here = PKG
    for i, part in enumerate(parts):
        if (here / part).is_dir():
            here = here / part
            continue
        if (here / f"{part}.py").is_file():
            rest = parts[i + 1:]
            return not rest or _defines(here / f"{part}.py", rest[0])
        return _defines(here / "__init__.py", part)
    return True


@pytest.mark.pure
@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_named_modules_exist(page):
    """Dotted references to the package's modules, in backquoted prose (`runtime.data.local_batch`).
    `plan.x` / `viz.x` / `records.x` are also variable names in examples: only those naming a
    module file are checked."""
    stale = []
    for span in re.findall(r"`([^`\n]+)`", prose(page)):
        for dotted in DOTTED.findall(span):
            parts = dotted.removeprefix("interactive_parallel.").split(".")
            ambiguous = parts[0] in ("plan", "viz", "records") and not dotted.startswith("interactive_parallel.")
            if ambiguous and not (PKG / parts[0] / f"{parts[1]}.py").is_file():
                continue
            if not _resolves(dotted):
                stale.append(dotted)
    assert not stale, f"{rel(page)} names modules or names that do not exist: {sorted(set(stale))}"


# ---------------------------------------------------------------- the README as a guide (pure)

@pytest.mark.pure
def test_readme_is_a_guide_linking_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < README_MAX_LINES, "the README is a guide: move reference text to docs/"
    assert "./dev.sh start" in readme and "./dev.sh test" in readme
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(readme)}
    index = DOCS / "index.md"
    in_index = {(DOCS / t.partition("#")[0]).resolve() for t in LINK.findall(index.read_text())}
    pages = set(DOCS.glob("*.md"))
    assert not pages - linked, f"pages the README does not link: {sorted(map(rel, pages - linked))}"
    unlisted = pages - {index} - in_index
    assert not unlisted, f"pages docs/index.md does not list: {sorted(map(rel, unlisted))}"
