"""The package's layers (docs/design.md) hold: import-linter's contracts in pyproject.toml are kept, and the
router starts without torch (a router box needs no PyTorch)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NO_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "safetensors"):
            raise ImportError(f"{name} is blocked: the router must not need it")
        return None

sys.meta_path.insert(0, NoTorch())
from prefixserve.router.app import build_router_app
from prefixserve.router.settings import RouterSettings
from prefixserve.cli import main

app = build_router_app(RouterSettings(replicas=("http://127.0.0.1:9",)))
router = app.state.router
assert router.tokenizer.encode("hello fleet"), "the router tokenizes without torch"
try:
    main(["route", "--help"])
except SystemExit as done:
    assert done.code == 0, done.code
assert "torch" not in sys.modules
print("router without torch: ok")
"""


def test_the_router_builds_and_tokenizes_without_torch(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", NO_TORCH],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PREFIXSERVE_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "router without torch: ok" in result.stdout
    # the router wrote the built-in model's tokenizer, never its weights
    written = sorted(path.name for path in (tmp_path / "cache").iterdir())
    assert written == ["prefixserve-tiny-v1-tokenizer"], written


def test_the_import_contracts_are_kept():
    # In a process of its own: import-linter reconfigures logging, which broke later tests' caplog.
    # --no-cache: nothing written into the clone; a broken contract prints which import broke it.
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_every_module_says_its_one_concept_in_its_first_line():
    """docs/style.md: a file holds one concept and names it in its docstring's first line; a file over 400 lines
    says in that line why it is still one concept. Files are split by responsibility, never to meet a line count."""
    import ast

    unnamed, unexplained = [], []
    for path in sorted((ROOT / "prefixserve").rglob("*.py")):
        source = path.read_text()
        name = str(path.relative_to(ROOT))
        docstring = ast.get_docstring(ast.parse(source), clean=False)
        first_line = docstring.splitlines()[0].strip() if docstring and docstring.strip() else ""
        if len(first_line) < 12:
            unnamed.append(name)
        elif source.count("\n") > 400 and "one concept" not in first_line:
            unexplained.append(f"{name}: {source.count(chr(10))} lines")
    assert not unnamed, f"modules whose docstring's first line does not name their concept: {unnamed}"
    assert not unexplained, f"over 400 lines, and the first line does not say why it is one concept: {unexplained}"


def test_no_class_inherits_two_of_the_packages_own_classes():
    """docs/style.md: an object owns its state; a mixin that reads another class's fields is one class in two
    files. Collaborators are fields, not bases."""
    import ast

    trees = {path: ast.parse(path.read_text()) for path in sorted((ROOT / "prefixserve").rglob("*.py"))}
    ours = {node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    mixed = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [base.id if isinstance(base, ast.Name) else getattr(base, "attr", "") for base in node.bases]
                if sum(base in ours for base in bases) > 1:
                    mixed.append(f"{path.relative_to(ROOT)}: {node.name}({', '.join(bases)})")
    assert not mixed, mixed


def test_an_engine_without_tiers_holds_an_empty_one_never_none():
    """A pool with nothing below it has an empty TieredKV (docs/style.md: an absent part is an object that does
    nothing), so no caller branches on `tiers is None`."""
    import re

    branches = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "prefixserve").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\btiers is (not )?None\b", line)
    ]
    assert not branches, branches


def test_no_two_modules_share_a_file_name():
    """docs/style.md: a file name says which concept it holds, so it names one module in the package."""
    from collections import defaultdict

    where = defaultdict(list)
    for path in sorted((ROOT / "prefixserve").rglob("*.py")):
        if path.name != "__init__.py":
            where[path.name].append(str(path.parent.relative_to(ROOT)))
    assert not {name: dirs for name, dirs in where.items() if len(dirs) > 1}


def test_no_two_modules_import_each_other():
    """A cycle of two modules is one concept in two files, or a part in the wrong one; a function-local import
    hides it from the layers contract, not from this graph (grimp, import-linter's, sees every import)."""
    import grimp

    graph = grimp.build_graph("prefixserve", exclude_type_checking_imports=True)
    cycles = sorted(
        (first, second)
        for first in graph.modules
        for second in graph.find_modules_directly_imported_by(first)
        if first < second and first in graph.find_modules_directly_imported_by(second)
    )
    assert not cycles, cycles
