"""Guard rails for what the import test cannot see: calls through attributes, and private names across a seam.

* No module installs a callable into another object (``other.hook = self`` / ``= self._method`` / ``= lambda`` /
  ``= a local function``): a component is asked through a declared interface, never wired into another's fields.
  The few patches of a third-party object (torch's, Python's builtins) are listed below with their reason.
* No module hands a constructor a closure that writes the caller's fields (``Job(start=start)`` where the nested
  ``start`` does ``self._spare = None``): the object made would write its maker's state from inside its own methods,
  a hidden seam. A job is given what it needs (a pool, a payload), never a callback into its owner.
* The loop (``driver.py``) and the trainer import no private name of the compiler: only what a compiler module
  exports in its ``__all__``.
"""
import ast
import importlib
import pathlib

import functrain

PACKAGE = pathlib.Path(functrain.__file__).parent

# (file, the assignment's target): a patch of another library's object, restored or scoped, with its reason
ALLOWED_PATCHES = {
    ("compiler/probe_memo.py", "cpu_vec_isa.VecISA.check_build"): "torch's ISA probe memoized (probe_memo), restored",
    ("compiler/cxx_units.py", "cpp_builder.CppBuilder.build"): "inductor's C++ build: the wrapper unit beside the "
                                                              "kernels' (side_by_side), restored",
    ("compiler/cxx_units.py", "loader.load_pybinding"): "inductor's JIT wrapper loader: the entry function at the "
                                                        "wrapper's level (entry_at_wrapper_level), restored",
    ("compiler/cache.py", "module.default_cache_dir"): "inductor's default folder replaced by a trusted one",
    ("compiler/host_sync.py", "builtins.print"): "print refused while a step is traced, restored after",
    ("distributed/agent.py", "context.close"): "torchrun's agent context closed within --term-timeout",
    ("distributed/prewarm.py", "handler._popen"): "torchrun's agent hands a rank to a process that imported torch "
                                                  "beside the launcher (handing_over), restored",
}


def _installs(source: str) -> list[tuple[int, str]]:
    """The assignments in ``source`` that put a callable (a lambda, a function defined in the module or in the
    enclosing function, ``self`` or one of its methods) into an attribute of another object than ``self``/``cls``:
    ``(line, target)``."""
    tree = ast.parse(source)
    module_defs = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    methods = {n.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in c.body
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found = []

    def visit(node: ast.AST, functions: set) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = {a.arg for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs}
            nested = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            functions = (functions - args) | nested
        if isinstance(node, ast.Assign):
            value = node.value
            callable_value = (isinstance(value, ast.Lambda)
                              or (isinstance(value, ast.Name) and (value.id in functions or value.id == "self"))
                              or (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
                                  and value.value.id == "self" and value.attr in methods))
            if callable_value:
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and not (isinstance(target.value, ast.Name)
                                                                  and target.value.id in ("self", "cls")):
                        found.append((node.lineno, ast.unparse(target)))
        for child in ast.iter_child_nodes(node):
            visit(child, functions)

    visit(tree, module_defs)
    return sorted(found)


def test_no_module_installs_a_callable_into_another_object():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        for line, target in _installs(path.read_text()):
            if (rel, target) not in ALLOWED_PATCHES:
                found[f"{rel}:{line}"] = target
    assert found == {}, found


def test_the_install_check_sees_a_planted_hook():
    planted = ("class Background:\n"
               "    def __init__(self, direct):\n"
               "        direct.fallback = self\n"
               "        direct.on_miss = self.on_miss\n"
               "        direct.done = lambda: None\n"
               "    def on_miss(self):\n"
               "        pass\n")
    assert [t for _, t in _installs(planted)] == ["direct.fallback", "direct.on_miss", "direct.done"]


# (file, the constructor, the closure): a closure that writes its maker's fields, with its reason
ALLOWED_CLOSURES = {
    ("compiler/jobs.py", "threading.Thread", "run"): "a compile thread's target sets its own job's result (the job "
                                                    "is the thread's only reader: ThreadJob, for comparison only)",
}


def _writes_of(function: ast.AST, name: str) -> bool:
    """Whether ``function``'s body assigns to an attribute (or an item of an attribute) of ``name``, or calls
    ``setattr(name, ...)``."""
    for node in ast.walk(function):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            while isinstance(target, (ast.Attribute, ast.Subscript)):
                if isinstance(target.value, ast.Name) and target.value.id == name:
                    return True
                target = target.value
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == name:
            return True
    return False


def _closures_passed(source: str) -> list[tuple[int, str, str]]:
    """The calls of a constructor (a capitalized name) in a method that pass it a nested function (or a lambda)
    writing the method's ``self``: ``(line, constructor, closure)``."""
    found = []
    for method in ast.walk(ast.parse(source)):
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or not method.args.args \
                or method.args.args[0].arg != "self":
            continue
        writers = {n.name for n in ast.walk(method) if n is not method
                   and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and "self" not in {a.arg for a in n.args.args + n.args.kwonlyargs} and _writes_of(n, "self")}
        for call in ast.walk(method):
            if not isinstance(call, ast.Call):
                continue
            made = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
            if not made[:1].isupper():
                continue
            for arg in [*call.args, *(k.value for k in call.keywords)]:
                if isinstance(arg, ast.Name) and arg.id in writers:
                    found.append((call.lineno, ast.unparse(call.func), arg.id))
                elif isinstance(arg, ast.Lambda) and any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                                                         and n.func.id == "setattr" for n in ast.walk(arg)):
                    found.append((call.lineno, ast.unparse(call.func), "lambda"))
    return sorted(found)


def test_no_constructor_is_handed_a_closure_that_writes_its_caller():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        for line, made, closure in _closures_passed(path.read_text()):
            if (rel, made, closure) not in ALLOWED_CLOSURES:
                found[f"{rel}:{line}"] = f"{made}(... {closure} ...)"
    assert found == {}, found


def test_the_closure_check_sees_a_planted_closure():
    """What the background compiler did before issue 37: a job made with closures that write its maker."""
    planted = ("class Background:\n"
               "    def _job(self, cap):\n"
               "        def start(key):\n"
               "            worker, self._spare = self._spare, None\n"
               "            self.progress.workers += 1\n"
               "            return worker\n"
               "        def load():\n"
               "            return cap.load()\n"
               "        def forget():\n"
               "            self.jobs[cap] = None\n"
               "        job = SharedJob(load, start, lead=True)\n"
               "        return jobs.Later(on_end=forget), Plain(load)\n")
    assert _closures_passed(planted) == [(11, "SharedJob", "start"), (12, "jobs.Later", "forget")]


def _private_compiler_imports(path: pathlib.Path) -> list[str]:
    """``from <functrain.compiler...> import X`` in ``path`` where ``X`` is private or not in that module's
    ``__all__``."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    here = ".".join(rel.parts[:-1]) if rel.name != "__init__" else ".".join(rel.parts[:-1])
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = here.split(".")
            base = base[:len(base) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if not module.startswith("functrain.compiler"):
            continue
        public = set(getattr(importlib.import_module(module), "__all__", ()))
        for alias in node.names:
            if alias.name.startswith("_") or alias.name not in public:
                bad.append(f"{module}.{alias.name}")
    return bad


def test_the_loop_and_the_trainer_import_no_private_compiler_name():
    files = [PACKAGE / "driver.py", *sorted((PACKAGE / "trainer").glob("*.py"))]
    found = {str(p.relative_to(PACKAGE)): bad for p in files if (bad := _private_compiler_imports(p))}
    assert found == {}, found


def test_the_private_import_check_sees_a_planted_import(tmp_path):
    planted = PACKAGE / "trainer" / "_planted_for_test.py"
    planted.write_text("from ..compiler.runtime import _unaliased\nfrom ..compiler import Runner\n")
    try:
        assert _private_compiler_imports(planted) == ["functrain.compiler.runtime._unaliased"]
    finally:
        planted.unlink()
