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


def split_top_level(text):
    """`text` split at the commas outside brackets and quotes."""
    parts, depth, quote, current = [], 0, None, ""
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += char
    if current.strip():
        parts.append(current.strip())
    return parts


def module_signatures(function, name):
    """Each overload's parameters as (name, has a default) and "*", from pybind11's docstring."""
    signatures = []
    for line in (function.__doc__ or "").splitlines():
        line = line.strip()
        line = line.split(". ", 1)[1] if line[:1].isdigit() and ". " in line else line
        if not line.startswith(name + "("):
            continue
        inside = line[len(name) + 1:line.rindex(") ->")]
        params = []
        for part in split_top_level(inside):
            if part == "*":
                params.append("*")
            else:
                params.append((part.split(":")[0].strip(), "=" in part))
        if params and params[0] != "*" and params[0][0] == "self":
            params = params[1:]
        signatures.append(params)
    return signatures


def stub_signature(node):
    arguments = node.args
    positional = arguments.posonlyargs + arguments.args
    defaults = [False] * (len(positional) - len(arguments.defaults)) + [True] * len(arguments.defaults)
    params = [(arg.arg, default) for arg, default in zip(positional, defaults)]
    if arguments.vararg:
        params.append(("*" + arguments.vararg.arg, False))
    elif arguments.kwonlyargs:
        params.append("*")
        params += [(arg.arg, default is not None)
                   for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults)]
    if arguments.kwarg:
        params.append(("**" + arguments.kwarg.arg, False))
    if params and params[0] != "*" and params[0][0] == "self":
        params = params[1:]
    return params


def stub_functions():
    """(owner class or None, function node) for every function and method of the stub, properties
    left out."""
    tree = ast.parse((ROOT / "python" / "kvsnap.pyi").read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield None, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                decorators = {getattr(d, "id", getattr(d, "attr", "")) for d in item.decorator_list} \
                    if isinstance(item, ast.FunctionDef) else set()
                if isinstance(item, ast.FunctionDef) and not decorators & {"property", "setter"}:
                    yield node.name, item


def test_the_stubs_parameters_are_the_modules():
    # Every function and method of the stub against pybind11's signature lines. Names, order, which have defaults and which are keyword-only: a caller following the stub
    # must not get a TypeError (names alone let all of these drift).
    checked = 0
    for owner, node in stub_functions():
        scope = kvsnap if owner is None else getattr(kvsnap, owner)
        function = getattr(scope, node.name)
        overloads = module_signatures(function, node.name)
        assert overloads, f"{owner}.{node.name}: no signature in {function.__doc__!r}"
        assert stub_signature(node) in overloads, (
            f"{owner}.{node.name}: the stub has {stub_signature(node)}, the module {overloads}")
        checked += 1
    assert checked >= 80, checked
