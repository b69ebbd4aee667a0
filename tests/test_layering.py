"""The layering rules of the design (each folder imports only the folders below it; nothing
imports ``deploy``), read from the source: every import a module runs, at its top or inside a
function, except those that only annotate (under ``if TYPE_CHECKING:``)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"engine", "kernels", "kvtransfer", "contracts", "prefill_worker", "decode_worker",
           "router", "proto", "deploy", "loadtests", "benchmarks", "tests"}
# folder -> the project folders it may import (itself always). The ingress reaches the workers
# through Serve handles, not imports; ``engine`` gives the roles their shared types.
MAY_IMPORT = {
    "kernels": set(),
    "engine": {"kernels"},
    "kvtransfer": {"engine", "kernels"},
    "contracts": {"engine"},
    "prefill_worker": {"engine", "kvtransfer", "contracts", "kernels"},
    "decode_worker": {"engine", "kvtransfer", "contracts", "kernels"},
    "router": {"proto", "contracts", "engine"},
    "proto": set(),
}


def runtime_imports(path: Path) -> set[str]:
    """The top-level names of the modules ``path`` imports when it runs."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & PROJECT


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_each_folder_imports_only_what_the_design_allows(folder):
    allowed = MAY_IMPORT[folder] | {folder}
    broken = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        extra = runtime_imports(path) - allowed
        if extra:
            broken[str(path.relative_to(ROOT))] = sorted(extra)
    assert not broken, f"{folder} may import {sorted(allowed)}; these import more: {broken}"


def module_imports(path: Path) -> set[str]:
    """The project modules ``path`` imports when it runs (dotted names, as written)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for child in node.body for n in ast.walk(child)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.split(".")[0] in PROJECT}


def test_no_import_circle():
    """No module imports, directly or through others, a module that imports it back (lazy
    imports inside functions count: they hide a circle, they do not remove it)."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for folder in MAY_IMPORT for p in (ROOT / folder).rglob("*.py")}
    graph = {name: {m for m in module_imports(path) if m in modules and m != name}
             for name, path in modules.items()}
    for name, deps in graph.items():  # a package's __init__ is not a circle with its modules
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    circles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                circles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, f"import circles: {circles}"


def test_the_checker_sees_lazy_imports_and_skips_annotations(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import deploy\n"
                      "def f():\n    from kvtransfer.types import TransferError\n")
    assert runtime_imports(module) == {"kvtransfer"}


def test_the_ingress_imports_no_torch_at_start():
    """The CPU-only ingress builds requests without torch or the Triton kernels (its tokenizer
    brings torch in later, at replica start, through transformers)."""
    import subprocess
    import sys

    code = ("import sys, router.ingress.app; "
            "print(sorted(m for m in ('torch', 'triton', 'kernels') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
