"""``ft.compile(step, cache_dir=..., package=True)``: the compiled step as a package a later process loads.

Inductor's on-disk caches still cost a later process the import of inductor itself
(~1.5 s on a small CPU), AOTAutograd's and inductor's cache lookups and a header
preprocess: seconds before the first step. A *package* skips all of it: the first
process compiles the captured graph ahead of time with AOTInductor into
``cache_dir/packages/<key>.pt2`` (a shared library plus JSON metadata, no pickle), and a
later process that traces the same graph loads it with torch's C++ loader
(milliseconds, inductor never imported) instead of compiling.

The key is the *traced* graph, never a guess from the step's Python code: a later
process traces the step (fractions of a second, as every capture does) and hashes the
graph's code with every input's shape, stride, dtype and device, the torch build, the
machine (host, CPU features, compiler) and the package format. A changed loss,
shape, device, torch version or machine is another key. Next to each package a JSON
file holds the full key material, compared in full before loading: a package whose
material differs, or that fails to load, is rebuilt with a warning, never used.
Files are written to a temporary name and renamed; the folder must be this user's
and not world-writable (:func:`functrain.compiler.cache.check_private_folder`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from typing import Any, Callable

import torch

from . import cache as compile_cache

__all__ = ["Packages"]

_FORMAT = 1


class Packages:
    """The packages of one cache folder: ``packages(gm, inputs, count)`` returns the compiled callable.

    ``count()`` is called once per graph built or loaded (``CompiledStep.compiles``).
    Attributes ``built`` and ``loaded`` count what this object did.
    """

    def __init__(self, folder: str):
        self.folder = compile_cache.check_private_folder(os.path.join(folder, "packages"))
        self.built = 0
        self.loaded = 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list, count: Callable[[], None]) -> Callable | None:
        """The package's callable for ``gm`` over ``inputs`` (loaded, else built); ``None``: not packageable."""
        if any(n.op == "get_attr" for n in gm.graph.nodes):  # not all of the graph is in its code: no safe key
            warnings.warn("ft.compile(package=True): the step's graph holds non-tensor attributes, which its "
                          "key cannot cover; compiling it without a package", stacklevel=5)
            return None
        devices = {t.device for t in inputs}
        if len(devices) > 1:
            warnings.warn(f"ft.compile(package=True): the step's tensors are on several devices "
                          f"({sorted(map(str, devices))}); compiling it without a package", stacklevel=5)
            return None
        material = _material(gm, inputs)
        key = hashlib.sha256(material.encode()).hexdigest()[:40]
        fn = self._load(key, material)
        if fn is None:
            with compile_cache.compile_lock("package-" + key):
                fn = self._load(key, material, quiet=True)  # another rank may have built it meanwhile
                if fn is None:
                    try:
                        fn = self._build(key, material, gm, inputs)
                    except Exception as e:  # noqa: BLE001 - an op AOTInductor cannot take: compile as usual
                        warnings.warn(f"ft.compile(package=True): could not build a package for this step "
                                      f"({type(e).__name__}: {str(e)[:500]}); compiling it without one",
                                      stacklevel=5)
                        return None
                    self.built += 1
                else:
                    self.loaded += 1
        else:
            self.loaded += 1
        count()
        return fn

    def _paths(self, key: str) -> tuple[str, str]:
        return os.path.join(self.folder, key + ".pt2"), os.path.join(self.folder, key + ".json")

    def _load(self, key: str, material: str, quiet: bool = False) -> Callable | None:
        package, sidecar = self._paths(key)
        if not os.path.exists(sidecar):
            return None
        try:
            with open(sidecar, encoding="utf-8") as f:
                stored = json.load(f)
            if not isinstance(stored, dict) or stored.get("material") != material:
                raise ValueError("its key material differs from this graph's")
            if stored.get("sha256") != _sha256(package):
                raise ValueError("its contents do not match the checksum written with it")
            fn = _loader(package, json.loads(material)["device"])
        except Exception as e:  # noqa: BLE001 - anything wrong with a package means: rebuild it
            if not quiet:
                warnings.warn(f"ft.compile(package=True): not loading {package!r} ({type(e).__name__}: {e}); "
                              f"compiling it again", stacklevel=6)
            for path in (sidecar, package):
                with contextlib.suppress(OSError):
                    os.unlink(path)
            return None
        return fn

    def _build(self, key: str, material: str, gm: torch.fx.GraphModule, inputs: list) -> Callable:
        from torch._inductor import aoti_compile_and_package
        package, sidecar = self._paths(key)
        program = torch.export.export(gm, tuple(inputs), strict=False)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{key}-", suffix=".pt2")
        os.close(fd)
        try:
            with compile_cache.probe_memo():
                aoti_compile_and_package(program, package_path=tmp)
            digest = _sha256(tmp)
            os.replace(tmp, package)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _write_json(sidecar, {"format": _FORMAT, "material": material, "sha256": digest})
        return _loader(package, json.loads(material)["device"])


def _material(gm: torch.fx.GraphModule, inputs: list) -> str:
    device = inputs[0].device if inputs else torch.device("cpu")
    return json.dumps({
        "format": _FORMAT,
        "graph": gm.code,
        "inputs": [[list(t.shape), list(t.stride()), str(t.dtype), str(t.device), t.requires_grad] for t in inputs],
        "device": [device.type, device.index],
        "machine": compile_cache.machine(),
        "functrain": _calling_convention(),
    }, sort_keys=True, default=str)


def _calling_convention() -> str:
    """A hash of the code that decides how a package is called (the capture's input order, the loader)."""
    h = hashlib.sha256()
    for path in (__file__, *(os.path.join(os.path.dirname(__file__), m) for m in ("capture.py", "memory.py"))):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _loader(package: str, device: list) -> Callable:
    index = -1 if device[0] == "cpu" else (device[1] if device[1] is not None else torch.cuda.current_device())
    loader = torch._C._aoti.AOTIModelPackageLoader(package, "model", False, 1, index)
    run = loader.run

    def call(*args: torch.Tensor) -> list:
        return run(list(args))

    call.loader = loader  # type: ignore[attr-defined]  # keeps the library loaded
    return call


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: str, data: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".pkg-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
