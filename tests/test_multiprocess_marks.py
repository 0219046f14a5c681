"""The ``multiprocess`` mark is true: every test that starts ranks (torch.distributed processes) or a Ray cluster
carries it, and no single-process test does. ``pytest -m "not multiprocess"`` is then the quick single-process run.

Read from the source (AST), per test function, following the module's own helper functions it calls and the
module-level constants it names (inline scripts, script paths). A test starts ranks when it

* runs ``run_ranks`` (tests/jobs.py) with a world size other than 1, or asks for the ``ray_cluster`` fixture, or
  calls ``ray.init``; or
* starts a process (``run_script``, ``run_job``, ``start_job``, ``subprocess``) on a script or command that starts
  ranks: a launcher command with ``--devices``/``--nproc-per-node``/``--num-nodes`` above 1, or a script (a file of
  the test tree, an inline script) that creates a ``Fabric``/strategy for more than one device and launches it,
  spawns processes, or initialises a process group itself (:func:`_rank_code`); or
* launches ranks in the test process itself (``mp.spawn``/``start_processes``, or a spawn/fork strategy whose
  ``launch(function)`` it calls outside ``pytest.raises``).

Where this reading is wrong for a test, a comment in it says so with the reason, and wins:
``# multiprocess-check: single process (...)`` or ``# multiprocess-check: starts ranks (...)``.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
JOB_CALLS = {"run_script", "run_job", "start_job", "run", "Popen", "check_output", "check_call"}
#: code that starts or joins ranks by itself, in a script a test runs (or in the test, for in-process launches)
STARTS_RANKS = re.compile(
    r"mp\.spawn|start_processes|torchrun|init_process_group|TorchTrainer|TorchCollective\(\)\.setup"
    r"|deepspeed\.init_distributed|\brun_ranks\("
)
#: a Fabric or strategy for more than one device (or one of the spawning strategies) ...
MULTI_DEVICE = re.compile(
    r"devices\s*=\s*(?:[2-9]|size|world|n_devices|devices|int\(sys\.argv|int\(os\.environ)|num_nodes\s*=\s*[2-9]"
    r"|ddp_spawn|ddp_fork|ddp_notebook"
)
#: ... that is launched
LAUNCHES = re.compile(r"\.launch\(|\bfabric\.run\(")


def _rank_code(text: str) -> bool:
    return bool(STARTS_RANKS.search(text) or (MULTI_DEVICE.search(text) and LAUNCHES.search(text)))


#: command-line arguments that start ranks (``fabric run --devices 2``, torchrun's ``--nproc-per-node 2``)
RANK_ARGS = re.compile(r"--(?:devices|nproc[-_]per[-_]node|num[-_]nodes|nnodes)['\"]?\s*[,=]?\s*['\"]?(?:[2-9]|\{)")


@cache
def _script_text(name: str) -> str:
    """The text of every file of the test tree called ``name`` (a script a test runs)."""
    return "\n".join(p.read_text() for p in TESTS.rglob(name) if p.is_file())


class Module:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.source = path.read_text()
        self.lines = self.source.splitlines()
        self.tree = ast.parse(self.source)
        self.functions = {n.name: n for n in ast.walk(self.tree) if isinstance(n, ast.FunctionDef)}
        self.constants: dict[str, str] = {}
        for node in self.tree.body:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.constants[target.id] = ast.unparse(node.value)
        marks = [ast.unparse(n.value) for n in self.tree.body if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)]  # fmt: skip
        self.module_marked = any("mark.multiprocess" in m for m in marks)

    def segment(self, node: ast.AST) -> str:
        return "\n".join(self.lines[node.lineno - 1 : node.end_lineno])

    def reachable(self, test: ast.FunctionDef) -> list[ast.FunctionDef]:
        """The test and the module's functions it calls, transitively."""
        seen: dict[str, ast.FunctionDef] = {}
        stack = [test]
        while stack:
            function = stack.pop()
            if function.name in seen:
                continue
            seen[function.name] = function
            for node in ast.walk(function):
                if isinstance(node, ast.Name) and node.id in self.functions and node.id not in seen:
                    stack.append(self.functions[node.id])
        return list(seen.values())

    def expand(self, text: str, depth: int = 2) -> str:
        """``text`` with the module constants it names appended (their source), and the files its ``.py`` names."""
        out = [text]
        names = set(re.findall(r"\b[A-Z_][A-Z0-9_]*\b", text))
        for name in names:
            if name in self.constants and depth:
                out.append(self.expand(self.constants[name], depth - 1))
        for name in set(re.findall(r"\b_?[a-z][a-z0-9_]*_(?:script|job|code)\b|\b_[A-Z][A-Z0-9_]*\b", text)):
            if name in self.constants and depth:
                out.append(self.expand(self.constants[name], depth - 1))
        for script in set(re.findall(r"['\"]([\w./-]+\.py)['\"]", "\n".join(out))):
            out.append(_script_text(Path(script).name))
        return "\n".join(out)

    def starts_ranks(self, test: ast.FunctionDef) -> str | None:
        """Why the test starts ranks or a Ray cluster, or None."""
        said = re.search(r"# multiprocess-check: (single process|starts ranks)", self.segment(test))
        if said:
            return None if said.group(1) == "single process" else "its comment says so"
        if "ray_cluster" in [a.arg for a in test.args.args]:
            return "uses the ray_cluster fixture"
        for function in self.reachable(test):
            for node in ast.walk(function):
                if not isinstance(node, ast.Call):
                    continue
                call = ast.unparse(node)
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name == "run_ranks" and not re.search(r"world_size\s*=\s*1\b", call):
                    return f"{call[:80]}"
                if call.startswith(("ray.init(", "mp.spawn(", "torch.multiprocessing.spawn(", "start_processes(")):
                    return f"{call[:80]}"
                if name in JOB_CALLS and (name != "run" or "subprocess" in call or "fabric" in call):
                    # what the started process runs may be named anywhere on the way (a helper takes the command)
                    target = self.expand(self._source_of(test)) + "\n" + self._written_scripts(function)
                    if RANK_ARGS.search(target) or _rank_code(target):
                        return f"{call[:80]}"
                if name == "launch" and node.args and not self._expects_an_error(function, node):
                    if _rank_code(self.expand(ast.unparse(function))):
                        return f"{call[:80]} in the test process"
        return None

    def _written_scripts(self, function: ast.FunctionDef) -> str:
        """Inline scripts the function writes to a file before running it (``path.write_text(SCRIPT)``), and the
        code it passes with ``-c``."""
        texts = []
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "write_text":
                texts.append(self.expand(ast.unparse(node.args[0])) if node.args else "")
        return "\n".join(texts)

    def _source_of(self, test: ast.FunctionDef) -> str:
        """The source of the test (its decorators' parameters included) and of every module function it reaches."""
        return "\n".join(self.segment(f) for f in self.reachable(test)) + "\n" + "\n".join(
            ast.unparse(d) for d in test.decorator_list
        )

    @staticmethod
    def _expects_an_error(function: ast.FunctionDef, call: ast.Call) -> bool:
        """``call`` sits in a ``with pytest.raises(...)`` block: refused before any process starts."""
        for node in ast.walk(function):
            if isinstance(node, ast.With) and any("raises" in ast.unparse(i.context_expr) for i in node.items):
                if any(inner is call for inner in ast.walk(node)):
                    return True
        return False


def _tests() -> list[tuple[Path, ast.FunctionDef, Module]]:
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        module = Module(path)
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                found.append((path, node, module))
    return found


def test_the_multiprocess_mark_is_true():
    missing, extra = [], []
    for path, test, module in _tests():
        marked = module.module_marked or any("mark.multiprocess" in ast.unparse(d) for d in test.decorator_list)
        why = module.starts_ranks(test)
        where = f"{path.relative_to(REPO)}::{test.name}"
        if why and not marked:
            missing.append(f"{where} ({why})")
        elif marked and not why:
            extra.append(where)
    assert not missing, "tests that start ranks or a Ray cluster without `@pytest.mark.multiprocess`:\n" + "\n".join(missing)
    assert not extra, "single-process tests marked `multiprocess` (mark the tests, not the module):\n" + "\n".join(extra)
