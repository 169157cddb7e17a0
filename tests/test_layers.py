"""Imports go one way (unit tier, no processes): every .py file of the layered packages is
parsed with ``ast``, imports inside functions included, and checked against one table.

    app (the mpipemoe commands) -> workers (inside a Ray Train worker) -> lm (model, data) -> moe_engine
    app -> moe_sim (the simulator, once it is a package) -> moe_engine

A module may import its own package and the packages its row of ``MAY_IMPORT`` names,
never one above it. Inside ``app``, a command module (one per ``mpipemoe`` subcommand, as
``app.cli.SUBCOMMANDS`` lists them) shares code with the others only through modules below
it (app/jobs/launch.py, app/tracking/store.py, ...): no app module imports a command module.

``app`` itself is a hall of thin commands over wings (docs/design.md §3), one folder each:

    app.commands -> app.jobs, app.bench -> app.reports -> app.tracking

A wing imports itself and the wings its row of ``WING_MAY_IMPORT`` names: commands import
wings, wings never import commands, reports read records and tracking only.
"""
from __future__ import annotations

import ast
from pathlib import Path

from app.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[1]

# package: the project packages it may import besides itself (top to bottom).
MAY_IMPORT = {
    "app": ("tune_spaces", "workers", "lm", "moe_sim", "moe_engine"),
    "tune_spaces": ("moe_engine",),  # the engine's one list of strategies (moe_engine.config)
    "workers": ("lm", "moe_engine"),
    "lm": ("moe_engine",),
    "moe_sim": ("moe_engine",),
    "moe_engine": (),
}
COMMANDS = {module for module, _ in SUBCOMMANDS.values()}

# app's wing (its folder): the other wings it may import. app's top-level modules (cli) import none.
WING_MAY_IMPORT = {
    "commands": ("jobs", "bench", "reports", "tracking"),
    "jobs": ("tracking",),
    "bench": ("reports", "tracking"),  # stacked layers price memory against time (reports.memory_time)
    "reports": ("tracking",),
    "tracking": (),
}
MAX_TOP_LEVEL_MODULES = 8  # app/*.py, __init__.py included

# Imports that break a rule today: (file, imported module) -> why, and when it goes. None left.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, at any depth; relative imports resolved,
    and ``from package import module`` read as ``package.module``."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                is_module = (root / submodule.replace(".", "/")).with_suffix(".py").is_file() \
                    or (root / submodule.replace(".", "/") / "__init__.py").is_file()
                found.append((node.lineno, submodule if is_module else base))
    return list(dict.fromkeys(found))  # `from x import a, b` once


def layered_files() -> list[Path]:
    return sorted(p for package in MAY_IMPORT for p in (ROOT / package).rglob("*.py"))


def violations() -> list[tuple[str, str, str]]:
    """(file:line, imported module, rule broken) of every import against the table."""
    found = []
    for path in layered_files():
        name = module_name(path)
        package = name.split(".")[0]
        for line, imported in imported_modules(path):
            target = imported.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{line}"
            if target in MAY_IMPORT and target != package and target not in MAY_IMPORT[package]:
                found.append((where, imported, f"{package} is below {target}: a lower layer imports a higher one"))
            broken = wing_rule(name, imported)
            if broken:
                found.append((where, imported, broken))
            if package == "app" and imported in COMMANDS and imported != name:
                kind = "command module" if name in COMMANDS else "module"
                found.append((where, imported, f"the {kind} {name} imports the command module {imported}: "
                                               f"share the code through a module below the commands"))
    return found


def _wing(module: str) -> str:
    """The wing of an app module (``app.jobs.launch`` -> ``jobs``); "" outside app and at its top level."""
    parts = module.split(".")
    return parts[1] if parts[0] == "app" and len(parts) > 2 else ""


def wing_rule(name: str, imported: str) -> str | None:
    """The rule ``name`` breaks by importing ``imported`` across app's wings, or None."""
    wing, imported_wing = _wing(name), _wing(imported)
    if not wing or not imported_wing or imported_wing == wing or imported_wing in WING_MAY_IMPORT.get(wing, ()):
        return None
    return (f"the wing app.{wing} imports app.{imported_wing}, which WING_MAY_IMPORT does not allow: "
            f"share it through a lower wing")


def _unexcused(found):
    return [v for v in found if (v[0].split(":")[0], v[1]) not in KNOWN_EXCEPTIONS]


def test_every_package_of_the_table_is_read():
    assert {"app", "workers", "lm", "moe_engine"} <= {p.relative_to(ROOT).parts[0] for p in layered_files()}
    assert len(COMMANDS) >= 10 and all((ROOT / (m.replace(".", "/") + ".py")).is_file() for m in COMMANDS)


def test_no_layer_imports_a_higher_one_and_no_command_imports_another():
    bad = _unexcused(violations())
    assert not bad, "imports against the layers (tests/test_layers.py):\n" + "\n".join(
        f"  {where} imports {imported}: {rule}" for where, imported, rule in bad)


def test_app_is_a_few_top_level_modules_over_the_wings():
    top = sorted(p.name for p in (ROOT / "app").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"app/ has {len(top)} top-level modules {top}: put new ones in a wing"
    folders = {p.parent.name for p in (ROOT / "app").glob("*/__init__.py")}
    assert folders == set(WING_MAY_IMPORT), f"app's folders {sorted(folders)} against WING_MAY_IMPORT's rows"
    for folder in folders:
        doc = ast.get_docstring(ast.parse((ROOT / "app" / folder / "__init__.py").read_text()))
        assert doc, f"app/{folder}/__init__.py: open with one sentence of what lives there"


def test_a_wing_importing_against_the_table_is_caught():
    assert wing_rule("app.reports.training", "app.bench.layer")  # reports read records and tracking only
    assert wing_rule("app.jobs.launch", "app.commands.train")    # wings never import commands
    assert wing_rule("app.commands.train", "app.jobs.launch") is None
    assert wing_rule("app.reports.training", "app.tracking.store") is None
    assert wing_rule("app.cli", "app.commands.train") is None    # the dispatcher is no wing


def test_every_known_exception_is_still_needed():
    used = {(where.split(":")[0], imported) for where, imported, _ in violations()}
    assert set(KNOWN_EXCEPTIONS) <= used, f"fixed: drop {set(KNOWN_EXCEPTIONS) - used} from KNOWN_EXCEPTIONS"


def test_the_checker_sees_imports_inside_functions_and_relative_ones(tmp_path):
    lower = ROOT / "lm" / "model.py"
    found = dict((module, line) for line, module in imported_modules(lower))
    assert "moe_engine" in found and "torch.nn.functional" in found
    engine = ROOT / "moe_engine" / "layers.py"
    assert any(module.startswith("moe_engine.") for _, module in imported_modules(engine))  # from .x import
    fake = tmp_path / "lm" / "fake.py"
    fake.parent.mkdir()
    fake.write_text("def f():\n    from app import train\n    import workers.loop\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "train.py").write_text("")
    assert imported_modules(fake, root=tmp_path) == [(2, "app.train"), (3, "workers.loop")]
