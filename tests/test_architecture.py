"""The architecture holds: layers point down, no module circles, one installable package."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("core", "frontend", "backends", "runners", "store", "cost_models", "search")


def test_the_layer_contract_is_kept():
    """``lint-imports`` reads the contract from pyproject.toml (also run by ``make lint``)."""
    from importlinter.cli import lint_imports

    assert lint_imports(config_filename=str(ROOT / "pyproject.toml")) == 0


def _contract_layers() -> list[str]:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = config["contracts"]
    return [m.strip() for layer in contract["layers"] for m in layer.split("|")]


def test_the_contract_places_every_module():
    """A module the contract does not name (itself or a package above it) is checked by no
    one: every module of the package must sit in a layer."""
    import grimp

    placed = _contract_layers()
    graph = grimp.build_graph("partune")
    loose = sorted(
        m
        for m in graph.modules
        if m != "partune" and not any(m == p or m.startswith(p + ".") for p in placed)
    )
    assert loose == []


def _private_imports() -> list[str]:
    """``from partune.x import _name`` anywhere in the package: a module reaching another's
    private name."""
    found = []
    files = {f for top in ("partune", *LAYERS) for f in (ROOT / top).rglob("*.py")}
    for f in sorted(files):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("partune"):
                found += [
                    f"{f.relative_to(ROOT)}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and a.name != "__version__"
                ]
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                base = node.value
                if isinstance(base, ast.Name) and base.id in _module_aliases(f):
                    found.append(f"{f.relative_to(ROOT)}: {base.id}.{node.attr}")
    return found


def _module_aliases(f: Path) -> set[str]:
    """The names a file binds to partune modules (``from partune.x import y`` where y is a
    module)."""
    names = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("partune"):
            for a in node.names:
                target = ROOT / "partune" / Path(*node.module.split(".")[1:], a.name)
                if target.with_suffix(".py").exists() or (target / "__init__.py").exists():
                    names.add(a.asname or a.name)
    return names


def test_no_module_reaches_another_modules_private_names():
    assert _private_imports() == []


def _circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in imports.get(m, ()):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            comp = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                comp.append(n)
                if n == m:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(imports):
        if m not in index:
            visit(m)
    return out


def test_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_circles():
    """Imports inside functions and type-only imports count too: a lazy import is still a
    dependency, and a type named from a module above is a circle a reader must follow."""
    import grimp

    graph = grimp.build_graph("partune", exclude_type_checking_imports=False)
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    assert _circles(imports) == []


def test_layers_live_in_their_own_top_level_folders():
    """The layout is part of the specification: each layer is a folder at the top, and
    ``partune/<layer>`` points at it, so there is one package and no second copy."""
    for layer in LAYERS:
        link = ROOT / "partune" / layer
        assert link.is_symlink() and link.resolve() == (ROOT / layer).resolve(), layer
        assert (ROOT / layer / "__init__.py").is_file(), layer


def test_modules_are_small_and_functions_short():
    """No module over 600 lines, no function over 96 (argparse tables aside).

    Set at 500 and 80 before ``ruff format`` at 100 columns put a long call's arguments on lines of
    their own; scaled by the ~20% that formatting added."""
    long_modules, long_functions = [], []
    for layer in (*LAYERS, "frontend/passes", "partune", "partune/commands"):
        for f in sorted((ROOT / layer).glob("*.py")):
            text = f.read_text()
            if text.count("\n") > 600:
                long_modules.append(f"{layer}/{f.name}")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = node.end_lineno - node.lineno + 1
                    if n > 96 and node.name not in ARGPARSE_TABLES:
                        long_functions.append(f"{layer}/{f.name}:{node.name}")
    assert long_modules == [] and long_functions == []


ARGPARSE_TABLES = {"build_parser"}


def test_the_wheel_holds_one_package(tmp_path):
    """``pip wheel`` follows the layer links: one top-level package, every layer inside."""
    src = tmp_path / "src"  # a copy: setuptools leaves build/ behind in the tree it builds
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "partune", *LAYERS):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name, **({"symlinks": True} if copy is shutil.copytree else {}))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("partune-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"partune"}
    for layer in LAYERS:
        assert f"partune/{layer}/__init__.py" in names, layer
    assert "partune/core/keys.py" in names and "partune/runners/worker_main.py" in names


def _layer_files(layer: str) -> list[Path]:
    if layer != "partune":
        return sorted((ROOT / layer).rglob("*.py"))
    return sorted(
        f
        for f in (ROOT / "partune").rglob("*.py")
        if f.relative_to(ROOT / "partune").parts[0] not in LAYERS
    )


def test_each_layer_exports_its_public_names_and_other_layers_import_them_from_it():
    """A layer's ``__all__`` is the surface the layers above use: each name resolves to the
    object its module defines, and no module of another layer imports past it into a module
    (submodules themselves aside, ``from partune.runners import module_file``; and the
    ``__init__`` files, which all take ``lazy_exports`` from core's module)."""
    import importlib
    import pkgutil

    for layer in LAYERS:
        package = importlib.import_module(f"partune.{layer}")
        assert package.__all__ == sorted(package.__all__) and len(set(package.__all__)) == len(
            package.__all__
        )
        # A name loaded lazily must not be a submodule's too: once anything imports the submodule,
        # Python binds it on the package and ``from partune.search import tune`` gets the module.
        assert set(package.__all__).isdisjoint(
            m.name for m in pkgutil.iter_modules(package.__path__)
        ), layer
        for name in package.__all__:
            value = getattr(package, name)
            assert getattr(value, "__module__", f"partune.{layer}").startswith(
                f"partune.{layer}"
            ), name
    past = []
    for layer in (*LAYERS, "partune"):
        for f in _layer_files(layer):
            if f.name == "__init__.py":
                continue
            for node in ast.walk(ast.parse(f.read_text())):
                if not (
                    isinstance(node, ast.ImportFrom) and (node.module or "").startswith("partune.")
                ):
                    continue
                parts = node.module.split(".")
                if len(parts) > 2 and parts[1] in LAYERS and parts[1] != layer:
                    past.append(
                        f"{f.relative_to(ROOT)}: from {node.module} import "
                        f"{', '.join(a.name for a in node.names)}"
                    )
    assert past == []
