"""The house's shape, checked: no layer imports upward, the runtime's folders import only the floors
below their own, no module imports itself through others (type-only imports counted), no file or
function outgrows what a reader takes in at once, every remote action of the Session has its
blocking twin made one way, and every record survives its dict round trip."""
from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from interactive_parallel import records
from interactive_parallel.cluster import Session

pytestmark = pytest.mark.pure
PACKAGE = Path(__file__).resolve().parents[1] / "interactive_parallel"

# layer -> the package modules it must never import (DESIGN.md: no arrow runs upward)
FORBIDDEN = {
    "plan": ("runtime", "cluster", "viz", "widgets", "cli", "torch", "ipyparallel", "ipywidgets", "plotly"),
    "records": ("plan", "runtime", "cluster", "viz", "widgets", "torch", "ipyparallel", "plotly"),
    "runtime": ("cluster", "viz", "widgets", "cli", "ipyparallel", "ipywidgets", "plotly"),
    "cluster": ("widgets", "cli", "ipywidgets"),
    "viz": ("runtime", "cluster", "widgets", "torch", "ipyparallel", "ipywidgets"),
    # The panel and the command line reach the ranks through the Session, and the client's own
    # runtime code (facts, dry runs) through cluster/offline.py, never runtime/ directly.
    "widgets": ("runtime", "cli"),
    "cli.py": ("runtime", "widgets"),
}

# runtime/'s folders (and its top modules) -> their floor: each imports only folders on lower
# floors, so siblings on one floor know nothing of each other (training and inference, the
# model and the probes). A new folder must be placed here.
RUNTIME_FLOORS = {
    "probes": 0,        # what a step did
    "model": 0,         # the transformers model before any layout
    "rank": 1,          # what a rank keeps, its channel, faults, a long loop's boundary
    "groups": 2,        # process groups and meshes
    "parallel": 3,      # one parallelism each
    "calibration": 3,   # timings on a bare group: no layout
    "layout": 4,        # the parallelisms composed under a plan
    "training": 5,
    "inference": 5,
    "checkpoints": 6,   # rebuilds a layout: its optimizer (training), full precision (inference)
    "client": 6,        # the dry run, the schedule preview, the script export: no peers
    "loop.py": 7,       # the long calls' frame and bodies
    "api.py": 8,        # what a client may ask a rank to do
}

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _import_froms(path: Path):
    """(module, names) of every `from ... import` in one file, at any level (functions and
    `if TYPE_CHECKING:` too), package-relative modules resolved against the package."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            yield name, [a.name for a in node.names]


def _imports(path: Path) -> set[str]:
    """Top-level names imported by one file, package-relative names resolved against the package,
    type-only imports (under `if TYPE_CHECKING:`) included: a circle of annotations is a circle."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    for name, names in _import_froms(path):
        out.add(name)
        out |= {f"{name}.{n}" for n in names}
    return out


def _layer_of(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "interactive_parallel" and len(parts) > 1:
        return parts[1]
    return parts[0]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_layer_imports_upward(layer):
    files = [PACKAGE / layer] if layer.endswith(".py") else sorted((PACKAGE / layer).rglob("*.py"))
    bad = []
    for f in files:
        for name in _imports(f):
            if _layer_of(name) in FORBIDDEN[layer]:
                bad.append(f"{f.relative_to(PACKAGE)} imports {name}")
    assert not bad, "\n".join(bad)


def _runtime_unit(name: str) -> str | None:
    """The runtime folder (or top module, 'api.py') a dotted package name lies in; None outside."""
    parts = name.split(".")
    if parts[:2] != ["interactive_parallel", "runtime"] or len(parts) < 3:
        return None
    return parts[2] if (PACKAGE / "runtime" / parts[2]).is_dir() else f"{parts[2]}.py"


def test_every_runtime_folder_has_a_floor():
    units = {p.name for p in (PACKAGE / "runtime").iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")}
    assert units == set(RUNTIME_FLOORS), f"place {sorted(units - set(RUNTIME_FLOORS))} in RUNTIME_FLOORS"


def test_runtime_folders_import_only_lower_floors():
    bad = []
    for f in sorted((PACKAGE / "runtime").rglob("*.py")):
        rel = f.relative_to(PACKAGE / "runtime")
        if rel == Path("__init__.py"):
            continue
        unit = rel.parts[0]
        for name in _imports(f):
            other = _runtime_unit(name)
            if other is not None and other != unit and RUNTIME_FLOORS[other] >= RUNTIME_FLOORS[unit]:
                bad.append(f"runtime/{rel} (floor {RUNTIME_FLOORS[unit]}) imports {name} "
                           f"(runtime/{other}, floor {RUNTIME_FLOORS[other]})")
    assert not bad, "\n".join(bad)


def test_nothing_imports_from_the_package_top():
    """interactive_parallel/__init__ is the user's door and imports the layers: a layer that took a
    name from it (`from .. import dry_run`) would import upward. Its subpackages may be named."""
    bad = []
    for f in sorted(PACKAGE.rglob("*.py")):
        if f == PACKAGE / "__init__.py":
            continue
        for module, names in _import_froms(f):
            if module == "interactive_parallel":
                bad += [f"{f.relative_to(PACKAGE)} imports {n} from the package top" for n in names
                        if not ((PACKAGE / n).is_dir() or (PACKAGE / f"{n}.py").is_file())]
    assert not bad, "\n".join(bad)


def test_no_file_or_function_is_too_long():
    """Files of at most MAX_FILE_LINES lines and functions of at most MAX_FUNCTION_LINES (its
    decorators, signature and docstring counted): beyond that a module holds two jobs."""
    bad = []
    for f in sorted(PACKAGE.rglob("*.py")):
        text = f.read_text()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            bad.append(f"{f.relative_to(PACKAGE)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - first + 1
                if length > MAX_FUNCTION_LINES:
                    bad.append(f"{f.relative_to(PACKAGE)}:{node.lineno} {node.name}: {length} lines")
    assert not bad, "\n".join(bad)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports at any level (function-level and type-only
    imports too); a package's __init__ only re-exports, so edges into it are left out."""
    modules = {".".join(f.relative_to(PACKAGE.parent).with_suffix("").parts): f for f in PACKAGE.rglob("*.py")
               if f.name != "__init__.py"}
    return {m: {n for n in _imports(f) if n in modules and n != m} for m, f in modules.items()}


def test_no_module_imports_itself_through_another():
    graph, cycles = _module_graph(), []

    def walk(node: str, path: list[str], on_path: set[str], done: set[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in on_path:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in done:
                on_path.add(nxt)
                walk(nxt, path + [nxt], on_path, done)
                on_path.discard(nxt)
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            walk(start, [start], {start}, done)
    assert not cycles, "import circles:\n" + "\n".join(sorted(set(cycles)))


def test_every_remote_action_has_one_body_and_a_blocking_twin():
    coroutines = {n for n, f in vars(Session).items() if n.endswith("_async") and inspect.iscoroutinefunction(f)}
    assert {"train_async", "generate_async", "apply_async", "load_model_async", "verify_async", "save_async",
            "load_async", "doctor_async", "run_async", "layout_async"} <= coroutines
    for name in coroutines:
        twin = getattr(Session, name[: -len("_async")])
        assert getattr(twin, "__wrapped_async__", None) is vars(Session)[name], f"{twin.__name__} written by hand"
        assert inspect.signature(twin) == inspect.signature(vars(Session)[name])
        assert twin.__doc__ and twin.__doc__ == vars(Session)[name].__doc__


def test_the_sessions_parts_make_their_twins_the_same_way():
    """Session's serving and planning calls live in mixins (cluster/session_*.py): each of their
    coroutines has its blocking twin too, made by blocking_twins, reached through Session."""
    parts = [c for c in Session.__mro__[1:] if c.__module__.startswith("interactive_parallel.")]
    assert parts, "Session has no parts"
    for part in parts:
        for name, fn in vars(part).items():
            if not (name.endswith("_async") and inspect.iscoroutinefunction(fn)):
                continue
            twin = getattr(Session, name[: -len("_async")])
            assert getattr(twin, "__wrapped_async__", None) is fn, f"{part.__name__}.{twin.__name__} written by hand"
            assert inspect.signature(twin) == inspect.signature(fn) and twin.__doc__ == fn.__doc__


def test_a_twin_written_by_hand_is_refused():
    from interactive_parallel.cluster.twins import blocking_twins

    class Twice:
        async def go_async(self):
            return 1

        def go(self):
            return 1

    with pytest.raises(TypeError, match="written by hand"):
        blocking_twins(Twice)


def _example(cls):
    """An instance of a record class with every field filled from its type."""
    values = {}
    hints = __import__("typing").get_type_hints(cls)
    nested = records.base._nested_fields(cls)
    for f in dataclasses.fields(cls):
        if f.name in nested:
            shape, rtype = nested[f.name]
            values[f.name] = _example(rtype) if shape == "one" else [_example(rtype), _example(rtype)]
            continue
        t = str(hints[f.name])
        values[f.name] = (True if "bool" in t else 3 if "int" in t else 0.5 if "float" in t else
                          [1, 2] if "list" in t else {"tp": 1} if "dict" in t else "x")
    return cls(**values)


@pytest.mark.parametrize("cls", list(records.RECORD_TYPES.values()), ids=list(records.RECORD_TYPES))
def test_every_record_survives_its_dict_round_trip(cls):
    rec = _example(cls)
    d = rec.to_dict()
    assert d["kind"] == cls.kind
    back = records.from_dict(__import__("json").loads(__import__("json").dumps(d)))
    assert back == rec and type(back) is cls


def test_the_pinned_versions_are_within_the_ranges_and_every_setup_uses_them():
    """constraints.txt (what the suite passed on) sits inside pyproject.toml's ranges, names each
    package once, and both set-ups install under it: ./dev.sh and Binder's requirements."""
    import tomllib

    from packaging.requirements import Requirement

    root = PACKAGE.parent
    pins = [Requirement(line) for line in (root / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    names = [p.name.lower().replace("_", "-") for p in pins]
    assert len(names) == len(set(names)), names
    assert all(str(p.specifier).startswith("==") for p in pins), "constraints pin exact versions"
    wanted = {Requirement(d).name.lower(): Requirement(d).specifier
              for d in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]}
    outside = [f"{p.name}{p.specifier} outside {wanted[n]}" for p, n in zip(pins, names)
               if n in wanted and not wanted[n].contains(str(p.specifier)[2:], prereleases=True)]
    assert not outside, outside
    assert "-c constraints.txt" in (root / "dev.sh").read_text()
    assert "-c ../constraints.txt" in (root / "binder" / "requirements.txt").read_text().splitlines()
