"""kvsnap.pyi describes the compiled module: the same public names, classes and members."""
import ast

import kvsnap
from conftest import ROOT

STUB_ONLY = {"ArrayLike"}  # a type alias of the stub


def stub_names():
    tree = ast.parse((ROOT / "python" / "kvsnap.pyi").read_text())
    names = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {item.name for item in node.body
                                if isinstance(item, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            names[target.id] = None
    return names


def public(names):
    return {name for name in names if not name.startswith("_") or name == "__version__"}


def test_the_stub_names_what_the_module_has():
    stub = stub_names()
    module = public(dir(kvsnap)) - {"__version__"}
    assert public(stub) - STUB_ONLY - {"__version__"} == module


def test_the_stub_lists_every_class_member():
    for name, members in stub_names().items():
        if members is None or name == "Error":
            continue
        cls = getattr(kvsnap, name)
        own = {member for member in vars(cls) if not member.startswith("_")}
        assert own <= members, f"{name}: not in the stub: {sorted(own - members)}"
        assert public(members) <= set(dir(cls)), f"{name}: not in the module"


def test_everything_has_a_docstring():
    for name in public(dir(kvsnap)) - {"__version__"}:
        assert getattr(kvsnap, name).__doc__, name


def test_the_version_is_the_projects():
    import re
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert kvsnap.__version__ == re.search(r"project\(kvsnap VERSION ([0-9.]+)", cmake).group(1)
