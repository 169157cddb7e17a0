"""Every GPU test has a CPU twin, so a change that breaks a GPU test's setup (a signature,
a constructor, a config type) fails on CPU-only CI too (issue 28: a GPU test passed a dict
where ``Trainer`` had come to expect a ``WorkerConfig``, and nothing on CPU noticed).

The convention: the GPU test's setup is a helper taking a device; ``<name>_cpu_twin``, in
the same module and not marked gpu, runs that helper on CPU at small sizes."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _marks(node: ast.AST) -> set[str]:
    """The pytest.mark.NAME marks in a decorator list or a ``pytestmark`` value."""
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}


def gpu_tests_and_twins(source: str) -> tuple[list[str], dict[str, bool]]:
    """(names of the tests marked gpu, {twin name: whether that twin is marked gpu})."""
    tree = ast.parse(source)
    module_gpu = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                     and "gpu" in _marks(n.value) for n in tree.body)
    gpu, twins = [], {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            marked = module_gpu or any("gpu" in _marks(d) for d in node.decorator_list)
            if node.name.endswith("_cpu_twin"):
                twins[node.name] = marked
            elif marked:
                gpu.append(node.name)
    return gpu, twins


def test_every_gpu_test_has_an_unmarked_cpu_twin():
    missing = []
    found = 0
    for path in sorted(TESTS.rglob("test_*.py")):
        gpu, twins = gpu_tests_and_twins(path.read_text())
        found += len(gpu)
        for name in gpu:
            if twins.get(f"{name}_cpu_twin") is not False:
                missing.append(f"{path.relative_to(TESTS)}::{name}")
    assert found >= 10, "no GPU tests found: has the gpu marker moved?"
    assert not missing, ("GPU tests without an unmarked `<name>_cpu_twin` that runs their setup helper on "
                         f"CPU (tests/test_gpu_twins.py): {missing}")


def test_the_check_sees_marks_on_tests_and_modules():
    source = ("import pytest\n@pytest.mark.gpu\ndef test_a(): pass\ndef test_a_cpu_twin(): pass\n"
              "@pytest.mark.gpu\ndef test_b_cpu_twin(): pass\ndef test_c(): pass\n")
    assert gpu_tests_and_twins(source) == (["test_a"], {"test_a_cpu_twin": False, "test_b_cpu_twin": True})
    assert gpu_tests_and_twins("import pytest\npytestmark = pytest.mark.gpu\ndef test_d(): pass\n") == (["test_d"], {})
