"""BUILD (Bazel) stays in step with the sources, checked without Bazel (it is not installable here).

A BUILD file is Starlark, whose syntax is a subset of Python's: ``ast`` parses it and a small
evaluator below runs its top level (``load``, assignments, rule calls; ``glob``, ``select`` and
``if_cuda_is_configured`` as expressions). From the evaluated rules the test checks that

- every source under ``cuda/`` (``.cc .cu .cuh .h``) is in the srcs/hdrs of a C++ rule, every
  ``jax_moe/**/*.py`` in a ``py_library``, every ``tests/*.py`` in a Python rule, every
  ``tests/test_*.py`` run by a ``py_test``, every ``notebooks/*.ipynb`` in some rule's data;
- every file BUILD names exists, and every local label (``:name``) is a target or an output of one;
- each pybind11 extension is built from the same .cc/.cu files as its CMake module in
  ``cuda/**/CMakeLists.txt`` (its sources and its linked libraries', wherever they are defined),
  is named like its ``PYBIND11_MODULE``, and lands in ``jax_moe/``.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import pathlib
import posixpath
import re

import pytest

ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent  # no resolve(): stay in Bazel's runfiles

FILE_ATTRS = ("srcs", "hdrs", "textual_hdrs", "data", "main")
LABEL_ATTRS = FILE_ATTRS + ("deps",)
CC_RULES = {"cc_library", "cc_binary", "cc_test", "cuda_library", "pybind_extension", "pybind_library"}
PY_RULES = {"py_library", "py_binary", "py_test"}
NATIVE_EXTENSIONS = (".cc", ".cu", ".cuh", ".h")
# Calls that BUILD files make for their side effect on the package, not to declare a target.
PACKAGE_FUNCTIONS = {"package", "licenses", "exports_files"}


@dataclasses.dataclass
class Rule:
    kind: str
    name: str
    attrs: dict
    line: int

    def strings(self, attr: str) -> list[str]:
        value = self.attrs.get(attr)
        if value is None:
            return []
        return [value] if isinstance(value, str) else list(value)

    def outputs(self) -> set[str]:
        """Names other rules may refer to with ``:name``: the target and the files it declares."""
        names = {self.name}
        if self.kind == "pybind_extension":  # a cc_binary NAME.so (+ a py_library NAME in recent versions)
            names.add(self.name + ".so")
        names.update(self.strings("outs"))
        return names


@dataclasses.dataclass
class BuildFile:
    rules: list[Rule]
    loads: dict[str, str]  # symbol -> .bzl label
    exported_files: list[str]

    def rule(self, name: str) -> Rule:
        return next(r for r in self.rules if r.name == name)


class StarlarkError(Exception):
    pass


class _Evaluator:
    """Evaluates the top level of a BUILD file: just enough Starlark for a declarative file."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.variables: dict[str, object] = {}
        self.loads: dict[str, str] = {}
        self.rules: list[Rule] = []
        self.exported: list[str] = []

    def fail(self, node, message):
        raise StarlarkError(f"BUILD:{getattr(node, 'lineno', '?')}: {message}")

    def run(self, text: str) -> BuildFile:
        module = ast.parse(text, filename="BUILD")
        for statement in module.body:
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
                self.statement_call(statement.value)
            elif isinstance(statement, ast.Assign) and len(statement.targets) == 1 \
                    and isinstance(statement.targets[0], ast.Name):
                self.variables[statement.targets[0].id] = self.value(statement.value)
            elif isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                continue  # a docstring
            else:
                self.fail(statement, f"unsupported statement {type(statement).__name__} (this checker "
                          "evaluates loads, assignments and rule calls; extend it if BUILD needs more)")
        return BuildFile(self.rules, self.loads, self.exported)

    def statement_call(self, call: ast.Call):
        if not isinstance(call.func, ast.Name):
            self.fail(call, "expected a plain function name")
        name = call.func.id
        if name == "load":
            bzl, *symbols = [self.value(a) for a in call.args]
            for symbol in symbols:
                self.loads[symbol] = bzl
            for keyword in call.keywords:
                self.loads[keyword.arg] = bzl
            return
        if call.args and name not in PACKAGE_FUNCTIONS:
            self.fail(call, f"{name}: rules take keyword arguments only")
        if name == "exports_files":
            self.exported.extend(self.value(call.args[0]))
            return
        if name in PACKAGE_FUNCTIONS:
            return
        attrs = {k.arg: self.value(k.value) for k in call.keywords}
        if "name" not in attrs:
            self.fail(call, f"{name}: no name")
        self.rules.append(Rule(name, attrs["name"], attrs, call.lineno))

    def value(self, node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self.value(k): self.value(v) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.Name):
            if node.id not in self.variables:
                self.fail(node, f"undefined name {node.id}")
            return self.variables[node.id]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.value(node.left) + self.value(node.right)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join":
            return self.value(node.func.value).join(self.value(node.args[0]))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = [self.value(a) for a in node.args]
            kwargs = {k.arg: self.value(k.value) for k in node.keywords}
            if node.func.id == "glob":
                return self.glob(node, *args, **kwargs)
            if node.func.id == "select":
                # Every branch may be taken: its files must all exist.
                return [item for branch in args[0].values() for item in branch]
            if node.func.id.startswith("if_") and node.func.id in self.loads:
                # if_cuda_is_configured(if_true, if_false=[]): both branches.
                return [item for branch in list(args) + list(kwargs.values()) for item in branch]
        self.fail(node, f"unsupported expression {ast.unparse(node)!r}")

    def glob(self, node, include, exclude=(), allow_empty=True, exclude_directories=1):
        found = set()
        for pattern in include:
            found.update(str(p.relative_to(self.root)) for p in self.root.glob(pattern) if p.is_file())
        for pattern in exclude:
            found.difference_update(str(p.relative_to(self.root)) for p in self.root.glob(pattern))
        if not found and not allow_empty:
            self.fail(node, f"glob({include}) matched nothing")
        return sorted(found)


def parse_build(text: str, root: pathlib.Path = ROOT) -> BuildFile:
    return _Evaluator(root).run(text)


def _local(label: str) -> str | None:
    """The package-relative name of a label of this package, None for an external one."""
    if label.startswith("@"):
        return None
    if label.startswith("//"):
        package, _, name = label[2:].partition(":")
        return name if package == "" else None  # another package of the monorepo: not checked
    return label[1:] if label.startswith(":") else label


def _location_args(rule: Rule) -> list[str]:
    return [m for arg in rule.strings("args") for m in re.findall(r"\$\((?:rootpath|location|execpath) ([^)]+)\)", arg)]


def _sources(root: pathlib.Path) -> dict[str, list[str]]:
    def files(directory, suffixes, recursive=True):
        base = root / directory
        if not base.is_dir():
            return []
        walk = base.rglob("*") if recursive else base.glob("*")
        return sorted(str(p.relative_to(root)) for p in walk
                      if p.is_file() and p.suffix in suffixes
                      and not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(root).parts))

    return {
        "native": files("cuda", NATIVE_EXTENSIONS) + files("jax_moe", NATIVE_EXTENSIONS),
        "package": files("jax_moe", (".py",)),
        "tests": files("tests", (".py",), recursive=False),
        "notebooks": files("notebooks", (".ipynb",), recursive=False),
    }


def _cmake_modules(root: pathlib.Path) -> dict[str, set[str]]:
    """Each pybind11 module of cuda/CMakeLists.txt (and its subdirectories') and the .cc/.cu files
    compiled into it: its own and those of the libraries it links, transitively."""
    sources: dict[str, set[str]] = {}  # target -> its own source files
    links: dict[str, set[str]] = {}  # target -> targets it links
    modules = []
    for path in sorted((root / "cuda").rglob("CMakeLists.txt")):
        folder = path.parent.relative_to(root).as_posix()
        text = re.sub(r"#[^\n]*", "", path.read_text())
        for command, name, body in re.findall(r"\b(pybind11_add_module|add_library|add_executable)\(\s*([\w$]+)([^)]*)\)",
                                              text):
            files = {posixpath.normpath(f"{folder}/{w}") for w in body.split() if w.endswith((".cc", ".cu", ".cpp"))}
            sources.setdefault(name, set()).update(files)
            if command == "pybind11_add_module":
                modules.append(name)
        for name, body in re.findall(r"\btarget_link_libraries\(\s*([\w$]+)([^)]*)\)", text):
            links.setdefault(name, set()).update(body.split())

    def closure(target):
        seen, stack, files = set(), [target], set()
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            files |= sources.get(current, set())
            stack.extend(t for t in links.get(current, ()) if t in sources)
        return files

    return {name: closure(name) for name in modules}


def _compiled_closure(build: BuildFile, rule: Rule) -> set[str]:
    """The .cc/.cu files compiled into a C++ target: its srcs and its local deps', transitively."""
    names = {r.name: r for r in build.rules}
    seen, stack, files = set(), [rule], set()
    while stack:
        current = stack.pop()
        if current.name in seen:
            continue
        seen.add(current.name)
        files.update(s for s in map(_local, current.strings("srcs")) if s and s.endswith((".cc", ".cu", ".cpp")))
        for dep in current.strings("deps"):
            local = _local(dep)
            if local in names:
                stack.append(names[local])
    return files


def check(build: BuildFile, root: pathlib.Path = ROOT, check_cmake: bool = True) -> list[str]:
    """Every inconsistency between BUILD and the source tree under ``root``, as messages."""
    problems = []
    rules = build.rules
    names = [r.name for r in rules]
    problems += [f"target {n!r} is defined more than once" for n in sorted({n for n in names if names.count(n) > 1})]
    targets = set().union(*(r.outputs() for r in rules)) if rules else set()

    # Everything BUILD names exists.
    named_files = {attr: {} for attr in FILE_ATTRS}  # attr -> file -> [rules]
    for rule in rules:
        for attr in LABEL_ATTRS:
            for label in rule.strings(attr):
                local = _local(label)
                if local is None:
                    continue
                if label.startswith(":") or local in targets:
                    if local not in targets:
                        problems.append(f"{rule.kind} {rule.name!r}: {attr} names {label!r}, which no target "
                                        "defines")
                    continue
                path = root / local
                if attr == "deps":
                    problems.append(f"{rule.kind} {rule.name!r}: deps names {label!r}, which no target defines")
                elif not path.is_file():
                    problems.append(f"{rule.kind} {rule.name!r}: {attr} names {local!r}, which does not exist")
                else:
                    named_files[attr].setdefault(local, []).append(rule)
        for local in map(_local, _location_args(rule)):
            if local and local not in rule.strings("srcs") + rule.strings("data") and local not in targets:
                problems.append(f"{rule.kind} {rule.name!r}: args name {local!r}, which is not in its srcs or data")
        main = rule.attrs.get("main")
        if main is not None and main not in rule.strings("srcs"):
            problems.append(f"{rule.kind} {rule.name!r}: main {main!r} is not in its srcs")
    for exported in build.exported_files:
        if not (root / exported).is_file():
            problems.append(f"exports_files names {exported!r}, which does not exist")

    def in_attr(path, attrs, kinds):
        return any(r.kind in kinds for attr in attrs for r in named_files[attr].get(path, []))

    # Every source is named, by the right kind of rule.
    sources = _sources(root)
    for path in sources["native"]:
        if not in_attr(path, ("srcs", "hdrs", "textual_hdrs"), CC_RULES):
            problems.append(f"{path} is not in the srcs/hdrs of any C++ rule ({', '.join(sorted(CC_RULES))})")
    for path in sources["package"]:
        if not in_attr(path, ("srcs",), {"py_library"}):
            problems.append(f"{path} is not in the srcs of any py_library")
    for path in sources["tests"]:
        if not in_attr(path, ("srcs",), PY_RULES):
            problems.append(f"{path} is not in the srcs of any py_library/py_binary/py_test")
        if pathlib.PurePath(path).name.startswith("test_"):
            run = any(r.kind == "py_test" and path in r.strings("srcs")
                      and (r.attrs.get("main") == path or path in map(_local, _location_args(r))) for r in rules)
            if not run:
                problems.append(f"{path}: no py_test runs it (as its main, or passed to its pytest main in args)")
    for path in sources["notebooks"]:
        if not in_attr(path, ("data",), CC_RULES | PY_RULES):
            problems.append(f"{path} is not in the data of any rule (tests/test_notebooks.py executes it)")

    # The pybind11 extensions match the CMake modules and the names jax_moe/_native.py imports.
    extensions = [r for r in rules if r.kind == "pybind_extension"]
    for rule in extensions:
        package, _, module = rule.name.rpartition("/")
        if package != "jax_moe":
            problems.append(f"pybind_extension {rule.name!r}: expected jax_moe/<module> so that it imports as "
                            "jax_moe.<module>")
        declared = set()
        for src in rule.strings("srcs"):
            path = root / (_local(src) or "")
            if path.is_file():
                declared.update(re.findall(r"PYBIND11_MODULE\(\s*(\w+)", path.read_text()))
        if declared and module not in declared:
            problems.append(f"pybind_extension {rule.name!r}: its sources define module(s) {sorted(declared)}, "
                            f"not {module!r}")
    if check_cmake and (root / "cuda" / "CMakeLists.txt").is_file():
        cmake = _cmake_modules(root)
        by_module = {r.name.rpartition("/")[2]: r for r in extensions}
        for module, files in cmake.items():
            if module not in by_module:
                problems.append(f"CMake builds module {module} but BUILD has no pybind_extension for it")
                continue
            compiled = _compiled_closure(build, by_module[module])
            if compiled != files:
                problems.append(f"pybind_extension {by_module[module].name!r} compiles {sorted(compiled)}, "
                                f"CMake's {module} compiles {sorted(files)}")
        for module in sorted(set(by_module) - set(cmake)):
            problems.append(f"BUILD has pybind_extension {by_module[module].name!r}, CMake builds no {module}")
    return problems


# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def build() -> BuildFile:
    path = ROOT / "BUILD"
    assert path.is_file(), f"{path} is missing"
    return parse_build(path.read_text())


def test_build_file_matches_the_sources(build):
    problems = check(build)
    assert not problems, "BUILD is out of step with the sources:\n  " + "\n  ".join(problems)


def test_build_file_declares_the_vendored_targets(build):
    kinds = {r.name: r.kind for r in build.rules}
    assert kinds.get("jax_moe") == "py_library"
    assert "cuda_library" in kinds.values() and "cc_library" in kinds.values()
    assert kinds.get("jax_moe/_jax_moe_cpu") == kinds.get("jax_moe/_jax_moe_cuda") == "pybind_extension"
    for symbol in ("cuda_library", "pybind_extension", "py_library", "py_test"):
        assert symbol in build.loads, f"{symbol} is used but not loaded"
    used = {r.kind for r in build.rules}
    native = {"cc_library", "cc_binary", "genrule", "filegroup", "py_library", "py_binary", "py_test"}
    unloaded = used - set(build.loads) - native
    assert not unloaded, f"rules used without a load(): {sorted(unloaded)}"
    # The CPU handlers use XLA's FFI API; the CUDA kernels are a cuda_library.
    ffi_users = [r.name for r in build.rules if "@xla//xla/ffi/api:ffi" in r.strings("deps")]
    assert "cpu_ops" in ffi_users and "cuda_ffi" in ffi_users, ffi_users
    assert any(r.kind == "cuda_library" and any(s.endswith(".cu") for s in r.strings("srcs")) for r in build.rules)


# The checker itself: it must fail on the two kinds of drift it exists to catch.

_TOY_BUILD = '''
load("@rules_python//python:defs.bzl", "py_library", "py_test")
load("@local_config_cuda//cuda:build_defs.bzl", "cuda_library", "if_cuda_is_configured")
SRCS = ["jax_moe/__init__.py"]
py_library(name = "jax_moe", srcs = SRCS + glob(["jax_moe/extra/*.py"]),
           data = if_cuda_is_configured([":lib"]))
cc_library(name = "lib", srcs = ["cuda/a.cc"], hdrs = select({"//conditions:default": ["cuda/a.h"]}))
py_test(name = "test_a", srcs = ["tests/test_a.py"], main = "tests/test_a.py", deps = [":jax_moe"])
'''


@pytest.fixture
def toy_tree(tmp_path):
    for name in ("jax_moe/__init__.py", "jax_moe/extra/more.py", "cuda/a.cc", "cuda/a.h", "tests/test_a.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    return tmp_path


def test_checker_accepts_a_consistent_tree(toy_tree):
    build = parse_build(_TOY_BUILD, toy_tree)
    assert build.rule("jax_moe").strings("srcs") == ["jax_moe/__init__.py", "jax_moe/extra/more.py"]
    assert check(build, toy_tree) == []


def test_checker_reports_a_source_missing_from_build(toy_tree):
    (toy_tree / "cuda" / "b.cu").write_text("")
    (toy_tree / "jax_moe" / "new.py").write_text("")
    (toy_tree / "tests" / "test_b.py").write_text("")
    problems = "\n".join(check(parse_build(_TOY_BUILD, toy_tree), toy_tree))
    assert "cuda/b.cu is not in the srcs/hdrs of any C++ rule" in problems
    assert "jax_moe/new.py is not in the srcs of any py_library" in problems
    assert "tests/test_b.py is not in the srcs" in problems and "tests/test_b.py: no py_test runs it" in problems


def test_checker_reports_a_named_file_or_target_that_does_not_exist(toy_tree):
    (toy_tree / "cuda" / "a.h").unlink()
    text = _TOY_BUILD.replace('deps = [":jax_moe"]', 'deps = [":jax_mo"]')
    problems = "\n".join(check(parse_build(text, toy_tree), toy_tree))
    assert "names 'cuda/a.h', which does not exist" in problems
    assert "':jax_mo', which no target defines" in problems


def test_checker_rejects_what_it_cannot_evaluate(toy_tree):
    with pytest.raises(StarlarkError, match="unsupported"):
        parse_build('[py_test(name = n) for n in ["a"]]', toy_tree)
    with pytest.raises(StarlarkError, match="undefined name"):
        parse_build('py_library(name = "a", srcs = MISSING)', toy_tree)
