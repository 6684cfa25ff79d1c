"""The house's shape, checked: no layer imports upward, no module imports itself through others,
every remote action of the Session has its blocking twin made one way, and every record
survives its dict round trip."""
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
}


def _imports(path: Path, typing_only: bool = True) -> set[str]:
    """Top-level names imported by one file, package-relative names resolved against the package.
    typing_only=False leaves out the imports under `if TYPE_CHECKING:`, which never run."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    out = set()
    tree = ast.parse(path.read_text())
    if not typing_only:
        tree.body = [n for n in tree.body if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}
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


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports at any level (function-level imports too);
    a package's __init__ only re-exports, so edges into it are left out."""
    modules = {".".join(f.relative_to(PACKAGE.parent).with_suffix("").parts): f for f in PACKAGE.rglob("*.py")
               if f.name != "__init__.py"}
    return {m: {n for n in _imports(f, typing_only=False) if n in modules and n != m} for m, f in modules.items()}


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
