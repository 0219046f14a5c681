"""The plugin boundary's counts (issue 37), read from the source (AST): what docs/decisions.md states and
``tests/core/plugin_host/test_plugin_sdk.py`` holds.

``python tests/architecture.py`` prints every count with its limit; each count is also a function the tests call:

* core modules the plugins import, and imported names no face lists in its ``__all__`` (the plugin SDK);
* private reaches: ``obj._name`` in a plugin where only the core defines ``_name``;
* copied helpers: code in a plugin distribution (and a free port in the benchmarks) that does by hand what a face
  publishes (:data:`COPIES` says what each pattern stands for and what to call instead);
* shims: modules left at an old path that only forward to a new one;
* ``attach`` overrides that declare anything but ``(self, binding)``;
* broad excepts (``except Exception``, ``except BaseException``, a bare ``except``) in the core and in the plugins,
  and those among them without a comment on the ``except`` line saying why they must be broad.

Standard library only, except for the faces' ``__all__`` (imported, which costs nothing: the faces are lazy).
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import sys
import tokenize
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "plugins"
CORE = REPO / "core" / "src" / "fabric_core"
BENCHMARKS = REPO / "benchmarks"

#: The faces of the plugin SDK (docs/plugins.md lists the same ones).
FACES = (
    "fabric_core",
    "fabric_core.accelerators",
    "fabric_core.environments",
    "fabric_core.io",
    "fabric_core.launchers",
    "fabric_core.loggers",
    "fabric_core.plugins",
    "fabric_core.precision",
    "fabric_core.strategies",
    "fabric_core.utilities",
)

#: The limits issue 37 set (docs/decisions.md, "The plugin boundary, counted").
LIMITS = {
    "core modules imported by plugins": 10,
    "names outside a face's __all__": 0,
    "private reaches": 0,
    "copied helpers": 0,
    "shims": 0,
    "attach overrides re-declaring keywords": 0,
    "broad excepts in the core": 15,
    "broad excepts in the plugins": 4,
    "broad excepts without a reason": 0,
    # ``utilities.guarded`` is one broad except that hands the error back as a value: each call is a catch-all as
    # much as an ``except Exception`` is, so they are counted too (a ratchet at the count measured when it came).
    "broad catches through guarded()": 22,
}


class Finding(NamedTuple):
    path: Path
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}: {self.what}"


def plugin_sources() -> list[Path]:
    """Every source file of the plugin distributions (``plugins/*/src``)."""
    return sorted(PLUGINS.glob("*/src/**/*.py"))


def core_sources() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


# ------------------------------------------------------------------------------------------------ the SDK
def core_imports(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of every import of the core in ``path`` (``name`` is ``*`` for ``import module``)."""
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fabric_core":
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "*") for a in node.names if a.name.split(".")[0] == "fabric_core"]
    return found


def imported_core_modules() -> set[str]:
    return {module for path in plugin_sources() for _, module, _ in core_imports(path)}


def names_outside_all() -> list[Finding]:
    exported = {face: set(importlib.import_module(face).__all__) for face in FACES}
    wrong = []
    for path in plugin_sources():
        for line, module, name in core_imports(path):
            if module not in exported:
                wrong.append(Finding(path, line, f"imports from {module} (not a face of the SDK: use one of {', '.join(FACES)})"))
            elif name not in exported[module]:
                wrong.append(Finding(path, line, f"{module}.{name} is not in that face's __all__"))
    return wrong


def _defined_private_names(root: Path) -> set[str]:
    """Private (``_x``) names a package defines itself: functions, classes, attributes it assigns, parameters."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reaches(library: set[str] = frozenset()) -> list[Finding]:
    """``obj._name`` in a plugin that is neither the plugin's own ``_name`` nor a library's (``library``: private
    members of torch objects, which the core touches too), but one only the core defines."""
    core_private = _defined_private_names(CORE) - set(library)
    wrong = []
    for package in sorted(PLUGINS.glob("*/src/*")):
        if not package.is_dir():
            continue
        own = _defined_private_names(package)
        for path in package.rglob("*.py"):
            for node in ast.walk(_tree(path)):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and node.attr in core_private
                    and node.attr not in own
                ):
                    wrong.append(Finding(path, node.lineno, f".{node.attr} is private to fabric_core"))
    return wrong


# ------------------------------------------------------------------------------------------------ copied helpers
def _call_name(node: ast.Call) -> str:
    """``os.killpg`` for ``os.killpg(...)``, ``bind`` for ``s.bind(...)``."""
    return ast.unparse(node.func)


def _is_free_port_probe(node: ast.AST) -> bool:
    """``sock.bind((host, 0))``: asking the OS for a free port."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "bind"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Tuple)
        and len(node.args[0].elts) == 2
        and isinstance(node.args[0].elts[1], ast.Constant)
        and node.args[0].elts[1].value == 0
    )


def _is_signal_exit_mapping(node: ast.AST) -> bool:
    """``128 - code`` / ``128 + signum``: a shell-style exit status computed by hand."""
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, (ast.Add, ast.Sub))
        and isinstance(node.left, ast.Constant)
        and node.left.value == 128
    )


def _is_call_to(*names: str) -> Callable[[ast.AST], bool]:
    def check(node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and _call_name(node).split(".")[-1] in names

    return check


def _is_rename(node: ast.AST) -> bool:
    """``os.rename``/``os.replace``/``path.rename(...)``: a move into place by hand (io's commits do it crash-safely)."""
    return isinstance(node, ast.Call) and (
        _call_name(node) in ("os.rename", "os.replace")
        or isinstance(node.func, ast.Attribute) and node.func.attr == "rename"
    )


def _is_env_int(node: ast.AST) -> bool:
    """``int(os.environ...)`` or a function of one's own named ``env_int``: an environment reader by hand."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name.lstrip("_") in ("env_int", "env_str", "env_float")
    return (
        isinstance(node, ast.Call)
        and _call_name(node) == "int"
        and len(node.args) == 1
        and "os.environ" in ast.unparse(node.args[0])
    )


def _is_backend_by_hand(node: ast.AST) -> bool:
    """A literal ``"nccl"``: the accelerator's ``distributed_backend`` says it."""
    return isinstance(node, ast.Constant) and node.value == "nccl"


#: What the torchrun variables of a process are; ``Topology.environment`` writes them.
_TORCHRUN_KEYS = {"LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE"}


def _is_torchrun_variables_by_hand(node: ast.AST) -> bool:
    """A dict that sets torchrun's per-process variables by hand, or ``node * per_node + local`` written out."""
    if isinstance(node, ast.Dict):
        keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
        return bool(keys & _TORCHRUN_KEYS) or {"RANK", "WORLD_SIZE"} <= keys
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Add)
        and isinstance(node.left, ast.BinOp)
        and isinstance(node.left.op, ast.Mult)
        and any(word in ast.unparse(node.left) for word in ("per_node", "nprocs"))
    )


def _is_missing_package_reason(node: ast.AST) -> bool:
    """``importlib.util.find_spec(...) is None`` inside ``unavailable_reason``: :func:`~fabric_core.utilities.
    missing_package` says it."""
    return (
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name == "unavailable_reason"
        and any(isinstance(n, ast.Call) and _call_name(n).endswith("find_spec") for n in ast.walk(node))
    )


#: ``(what was copied, what to call instead, the pattern)``.
COPIES: tuple[tuple[str, str, Callable[[ast.AST], bool]], ...] = (
    ("a free port picked by hand", "fabric_core.environments.find_free_port", _is_free_port_probe),
    ("a process group signalled by hand", "fabric_core.launchers.signal_process_tree / stop_process_tree", _is_call_to("killpg")),
    ("a death signal set by hand (prctl)", "fabric_core.launchers.die_with_parent / parent_death_signal", _is_call_to("prctl")),
    ("an exit status mapped by hand (128 +/- N)", "fabric_core.launchers.exit_status", _is_signal_exit_mapping),
    ("the default dtype switched by hand", "fabric_core.precision.DefaultDtype", _is_call_to("set_default_dtype")),
    ("an environment variable read by hand", "fabric_core.environments.env_int / env_str", _is_env_int),
    ("a process-group backend chosen by hand", "the accelerator's distributed_backend", _is_backend_by_hand),
    ("torchrun's variables written by hand", "fabric_core.strategies.Topology.environment", _is_torchrun_variables_by_hand),
    ("a rename into place by hand", "fabric_core.io.commit_file / commit_directory", _is_rename),
    ("a missing package's reason written by hand", "fabric_core.utilities.missing_package", _is_missing_package_reason),
)


def _benchmark_sources() -> list[Path]:
    return sorted(p for p in BENCHMARKS.rglob("*.py") if p.name != "_common.py")


def copied_helpers() -> list[Finding]:
    """Every place in a plugin distribution that does by hand what a face publishes; and a free port picked by hand
    in the benchmarks outside ``benchmarks/_common.py`` (which holds their one helper)."""
    found = []
    for path in plugin_sources():
        for node in ast.walk(_tree(path)):
            for what, instead, pattern in COPIES:
                if pattern(node):
                    found.append(Finding(path, node.lineno, f"{what}: call {instead}"))
    for path in _benchmark_sources():
        for node in ast.walk(_tree(path)):
            if _is_free_port_probe(node):
                found.append(Finding(path, node.lineno, "a free port picked by hand: call benchmarks._common.free_port"))
    return found


# ------------------------------------------------------------------------------------------------ shims
def shims() -> list[Finding]:
    """Modules that only forward to another module (a moved module's old path): a ``moved_module`` call, or a body
    that is nothing but a docstring, imports and ``__all__``/``__getattr__`` forwarding to one other module of ours,
    with a deprecation warning."""
    found = []
    for path in [*core_sources(), *plugin_sources()]:
        text = path.read_text()
        if "moved_module" in text:
            found.append(Finding(path, 1, "a moved_module shim"))
            continue
        tree = _tree(path)
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        forwards = body and all(isinstance(n, (ast.Import, ast.ImportFrom, ast.Assign, ast.FunctionDef)) for n in body)
        if forwards and "DeprecationWarning" in text and path.name != "__init__.py":
            found.append(Finding(path, 1, "a module that only forwards, with a DeprecationWarning"))
    return found


# ------------------------------------------------------------------------------------------------ attach
def attach_redeclaring() -> list[Finding]:
    """``def attach(...)`` of a strategy (a class of the core's ``strategies`` package or of a plugin whose name or
    bases name a strategy) whose parameters are not ``(self, binding)``."""
    found = []
    for path in [*core_sources(), *plugin_sources()]:
        classes = [node for node in ast.walk(_tree(path)) if isinstance(node, ast.ClassDef)]
        strategies = [
            c for c in classes
            if "strategies" in path.parts or "Strategy" in c.name or any("Strategy" in ast.unparse(b) for b in c.bases)
        ]
        for node in (n for c in strategies for n in c.body):
            if isinstance(node, ast.FunctionDef) and node.name == "attach":
                arguments = node.args
                names = [a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]]
                if names != ["self", "binding"] or arguments.vararg or arguments.kwarg:
                    found.append(Finding(path, node.lineno, f"attach({', '.join(names)}) re-declares the binding"))
    return found


# ------------------------------------------------------------------------------------------------ broad excepts
def _comments(path: Path) -> dict[int, str]:
    out = {}
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.COMMENT:
            out[token.start[0]] = token.string
    return out


def _broad(handler: ast.ExceptHandler) -> str | None:
    if handler.type is None:
        return "bare except"
    for node in handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]:
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if name in ("Exception", "BaseException"):
            return f"except {name}"
    return None


#: ``noqa: BLE001`` and the like at the start of a comment: a linter's code, not a reason.
_NOQA = re.compile(r"^noqa(:\s*[A-Z]+[0-9]+(,\s*[A-Z]+[0-9]+)*)?\s*")


def broad_excepts(paths: list[Path]) -> list[Finding]:
    """Every broad ``except`` in ``paths``; ``what`` ends with ``(no reason given)`` where no comment on the ``except``
    line (a ``noqa`` alone is no reason) says why it must be broad."""
    found = []
    for path in paths:
        comments = None
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ExceptHandler):
                kind = _broad(node)
                if kind is None:
                    continue
                comments = _comments(path) if comments is None else comments
                comment = comments.get(node.lineno, "")
                reason = re.sub(_NOQA, "", comment.split("#", 1)[-1].strip()).strip(" -()")
                found.append(Finding(path, node.lineno, kind if reason else f"{kind} (no reason given)"))
    return sorted(found, key=lambda f: (str(f.path), f.line))


def broad_excepts_in_core() -> list[Finding]:
    return broad_excepts(core_sources())


def broad_excepts_in_plugins() -> list[Finding]:
    return broad_excepts(plugin_sources())


def guarded_calls(paths: list[Path]) -> list[Finding]:
    """Every call of ``guarded(...)`` (``utilities.exceptions.guarded``: ``Exception`` caught, handed back)."""
    found = []
    for path in paths:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name == "guarded":
                    found.append(Finding(path, node.lineno, "guarded(...)"))
    return sorted(found, key=lambda f: (str(f.path), f.line))


def unexplained(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.what.endswith("(no reason given)")]


# ------------------------------------------------------------------------------------------------ report
def counts(library_private: set[str] = frozenset()) -> dict[str, tuple[int, list[str]]]:
    """Every count of :data:`LIMITS`, with what was found (as ``path:line: what`` lines)."""
    core_broad, plugin_broad = broad_excepts_in_core(), broad_excepts_in_plugins()
    lists: dict[str, list[object]] = {
        "core modules imported by plugins": sorted(imported_core_modules()),
        "names outside a face's __all__": names_outside_all(),
        "private reaches": private_reaches(library_private),
        "copied helpers": copied_helpers(),
        "shims": shims(),
        "attach overrides re-declaring keywords": attach_redeclaring(),
        "broad excepts in the core": core_broad,
        "broad excepts in the plugins": plugin_broad,
        "broad excepts without a reason": unexplained(core_broad + plugin_broad),
        "broad catches through guarded()": guarded_calls([*core_sources(), *plugin_sources()]),
    }
    return {name: (len(items), [str(item) for item in items]) for name, items in lists.items()}


def torch_private_members() -> set[str]:
    """Private members of torch's modules, optimizers and device meshes (``_buffers``, ``DeviceMesh._flatten``): the
    library's, touched by core and plugins alike."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    module, optimizer = torch.nn.Module(), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return set(dir(module)) | set(dir(optimizer)) | set(dir(DeviceMesh))


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    over = 0
    for name, (count, items) in counts(torch_private_members()).items():
        limit = LIMITS[name]
        mark = "ok" if count <= limit else "OVER"
        over += count > limit
        print(f"{count:5d}  (limit {limit:3d})  {mark:4s}  {name}")
        if verbose or count > limit:
            for item in items:
                print(f"         {item}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
