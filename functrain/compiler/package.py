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

Trust: the folder must pass :func:`functrain.compiler.cache.check_private_folder`
(this user's, writable by no one else, nothing in it another user's); otherwise the
packages are kept in functrain's private folder instead, with a warning. And the
sidecar's checksum is not trusted by itself (whoever swapped the package could
rewrite it): the sidecar also holds an HMAC-SHA256 of the key material and the
package's SHA-256 under a key only this user can read (``package.key``, 32 random
bytes, ``0600``, in functrain's private ``0700`` folder,
:func:`functrain.compiler.trust.private_home`). A package is loaded only if the
HMAC of what is on disk matches: a package this user did not build (copied from
elsewhere, or changed) is rebuilt with a warning. Files are written to a temporary
name and renamed.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import stat
import tempfile
import warnings
from typing import Any, Callable

import torch

from . import cache as compile_cache
from .cxx_units import side_by_side
from .graph_lock import compile_lock
from .probe_memo import machine, probe_memo
from .rewrites import split_foreach_norms
from . import trust

__all__ = ["Packages", "PackageCall"]

_FORMAT = 3  # 2: the sidecar holds an HMAC under this user's key; 3: graphs with collectives, GIL-free
_KEY_BYTES = 32


class Packages:
    """The packages of one cache folder: ``packages(gm, inputs, count)`` returns the compiled callable.

    ``count()`` is called once per graph built or loaded (``CompiledStep.compiles``).
    Attributes ``built`` and ``loaded`` count what this object did.
    """

    def __init__(self, folder: str, lock_timeout: float = 600.0):
        self.lock_timeout = lock_timeout
        root = compile_cache.trusted_folder(os.fspath(folder), "the cache_dir")
        self.folder = compile_cache.check_private_folder(os.path.join(root, "packages"), contents=False)
        self.key = package_key()
        self.built = 0
        self.loaded = 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list, count: Callable[[], None]) -> Callable | None:
        """The package's callable for ``gm`` over ``inputs`` (loaded, else built); ``None``: not packageable."""
        devices = {t.device for t in inputs}
        if not takes(gm, next(iter(devices), torch.device("cpu"))):
            warnings.warn(f"ft.compile(package=True): {NO_COLLECTIVES}; compiling it without a package",
                          stacklevel=5)
            return None
        if any(n.op == "get_attr" for n in gm.graph.nodes):  # not all of the graph is in its code: no safe key
            warnings.warn("ft.compile(package=True): the step's graph holds non-tensor attributes, which its "
                          "key cannot cover; compiling it without a package", stacklevel=5)
            return None
        if len(devices) > 1:
            warnings.warn(f"ft.compile(package=True): the step's tensors are on several devices "
                          f"({sorted(map(str, devices))}); compiling it without a package", stacklevel=5)
            return None
        material = _material(gm, inputs)
        key = hashlib.sha256(material.encode()).hexdigest()[:40]
        fn = self._load(key, material)
        if fn is None:
            with compile_lock("package-" + key, self.lock_timeout):
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
            digest = _sha256(package)
            if stored.get("sha256") != digest:
                raise ValueError("its contents do not match the checksum written with it")
            if not hmac.compare_digest(str(stored.get("hmac", "")), _sign(self.key, material, digest)):
                raise ValueError("its checksum is not signed with this user's package key (built by someone "
                                 "else, or changed since)")
            fields = json.loads(material)
            fn = _loader(package, fields["device"], key, "_c10d_functional." in fields["graph"])
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
        if _collective(gm) or all(t.device.type == "cpu" for t in inputs if torch.is_tensor(t)):
            # no op called through Python by the proxy executor: a GIL-free runner (_FreeRunner) has none, and on
            # the CPU it is the direct path's graph (the backend splits its norms too): the same numbers
            gm = split_foreach_norms(gm)
        program = torch.export.export(gm, tuple(inputs), strict=False)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{key}-", suffix=".pt2")
        os.close(fd)
        try:
            # on the CPU the graph's random ops call torch's own kernels (fallback_random), as the direct path's
            # graphs do: its draws are eager's (core.rng), and a warm start can check it against the eager step
            cpu = json.loads(material)["device"][0] == "cpu"
            with probe_memo(ahead=cpu), side_by_side():  # (the wrapper's C++ beside the kernels')
                aoti_compile_and_package(program, package_path=tmp,
                                         inductor_configs={"fallback_random": True} if cpu else None)
            if _collective(gm):
                _check_self_contained(tmp)
            digest = _sha256(tmp)
            os.replace(tmp, package)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _write_json(sidecar, {"format": _FORMAT, "material": material, "sha256": digest,
                              "hmac": _sign(self.key, material, digest)})
        return _loader(package, json.loads(material)["device"], key, _collective(gm))

    def load_key(self, key: str) -> "PackageCall | None":
        """The package ``key`` loaded without its graph at hand (a warm start,
        :mod:`functrain.compiler.warm`): its sidecar's signature and checksum are checked, and its key material
        must name this machine and this functrain's calling convention; ``None``: no such package (or a damaged
        one, deleted with a warning)."""
        package, sidecar = self._paths(key)
        try:
            with open(sidecar, encoding="utf-8") as f:
                stored = json.load(f)
        except (OSError, ValueError):
            return None
        material = stored.get("material") if isinstance(stored, dict) else None
        try:
            fields = json.loads(material) if isinstance(material, str) else None
        except ValueError:
            fields = None
        if not isinstance(fields, dict) or fields.get("functrain") != _calling_convention() \
                or json.dumps(fields.get("machine"), sort_keys=True, default=str) \
                != json.dumps(machine(), sort_keys=True, default=str):
            return None
        return self._load(key, material)

    def sign(self, name: str, text: str) -> str:
        """An HMAC of ``text`` under this user's package key, for the record ``name`` (a warm entry)."""
        return _sign(self.key, "warm:" + name, text)

    def write_json(self, path: str, data: Any) -> None:
        """Write ``data`` as JSON to ``path`` in this folder (a temporary file renamed: never torn)."""
        _write_json(path, data)


class PackageCall:
    """A loaded package's callable over the graph's inputs; ``key``: the package's key."""

    __slots__ = ("key", "loader", "_run")

    def __init__(self, loader: Any, key: str):
        # (the loader keeps the library loaded)
        self.key, self.loader = key, loader
        self._run = loader.run if not isinstance(loader, _FreeRunner) else loader

    def __call__(self, *args: torch.Tensor) -> list:
        return self._run(list(args))

    @property
    def frees_the_gil(self) -> bool:
        """Whether a call lets other Python threads run (a package with collectives: :class:`_FreeRunner`)."""
        return isinstance(self.loader, _FreeRunner)


NO_COLLECTIVES = ("the step's graph holds collectives (data parallelism), which only a CPU package may hold: a rank "
                  "waiting in a collective must let other threads take the GIL (a gloo worker thread needs it to "
                  "free an earlier collective's tensors, and the rank deadlocks otherwise), and functrain's "
                  "GIL-free runner is the CPU's")


def takes(gm: torch.fx.GraphModule, device: torch.device) -> bool:
    """Whether a graph on ``device`` may be packaged: it holds no collective, or it runs on the CPU, where a
    graph with collectives runs in :class:`_FreeRunner` (:data:`NO_COLLECTIVES`)."""
    return device.type == "cpu" or not _collective(gm)


def _collective(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and str(n.target).startswith("_c10d_functional.") for n in gm.graph.nodes)


def _check_self_contained(package: str) -> None:
    """Refuse (``ValueError``) a package whose code calls an op through torch's proxy executor (an op without a C
    shim, listed in the wrapper's JSON): :class:`_FreeRunner` runs only code that calls none."""
    import zipfile
    with zipfile.ZipFile(package) as z:
        for name in z.namelist():
            if name.endswith(".wrapper.json"):
                nodes = json.loads(z.read(name)).get("nodes") or []
                if nodes:
                    ops = sorted({str(n.get("node", {}).get("target")) for n in nodes})
                    raise ValueError(f"its code calls {ops} through torch's proxy executor, which the GIL-free "
                                     f"runner of a graph with collectives does not have")


class _FreeRunner:
    """A CPU package's model run through its C interface with the GIL released (``ctypes``), for a graph that
    waits in collectives: torch's own loader holds the GIL for the whole call, and a gloo worker thread that
    needs the GIL meanwhile (to free an earlier collective's tensors) deadlocks the rank.

    The package's shared library is copied to a private temporary folder, loaded, and deleted at once (the
    mapping stays; nothing is left on disk). Its code must call no op through torch's proxy executor
    (:func:`_check_self_contained`). Tensors cross as ``at::Tensor`` handles made and taken by torch's own
    ``torch._C._aoti`` helpers."""

    def __init__(self, package: str):
        import ctypes
        import shutil
        import zipfile
        _check_self_contained(package)
        with zipfile.ZipFile(package) as z:
            libs = [n for n in z.namelist() if n.endswith(".so") and "/data/aotinductor/model/" in n]
            if len(libs) != 1:
                raise ValueError(f"the package holds {len(libs)} model libraries, not 1")
            folder = tempfile.mkdtemp(prefix="functrain-aoti-")  # (0700: nobody else can swap the file)
            try:
                path = os.path.join(folder, "model.so")
                with open(path, "wb") as f:
                    f.write(z.read(libs[0]))
                self._lib = ctypes.CDLL(path)  # (CDLL: a call releases the GIL)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        api = ctypes.pythonapi
        self._pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
            ("PyCapsule_GetPointer", api))
        self._capsule = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
            ("PyCapsule_New", api))
        self._ctypes = ctypes
        self._handle = ctypes.c_void_p()
        self._check(self._lib.AOTInductorModelContainerCreateWithDevice(
            ctypes.byref(self._handle), ctypes.c_size_t(1), b"cpu", None), "create the model")
        outputs = ctypes.c_size_t()
        self._check(self._lib.AOTInductorModelContainerGetNumOutputs(self._handle, ctypes.byref(outputs)),
                    "count its outputs")
        self._outputs = outputs.value
        self._run = self._lib.AOTInductorModelContainerRun

    def __call__(self, args: list) -> list:
        c = self._ctypes
        handles = [self._pointer(h, None) for h in torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(args)]
        inputs = (c.c_void_p * len(handles))(*handles)  # (taken by the model)
        outputs = (c.c_void_p * self._outputs)()
        self._check(self._run(self._handle, inputs, c.c_size_t(len(handles)), outputs,
                              c.c_size_t(self._outputs), None, None), "run")
        return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs([self._capsule(h, None, None)
                                                                         for h in outputs])

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"ft.compile(package=True): the package's model failed to {what} (AOTInductor "
                               f"error {code}; its message is on stderr)")

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)  # (a runner whose construction failed has none)
        if handle is not None and handle.value:
            try:
                self._lib.AOTInductorModelContainerDelete(handle)
            except Exception:  # noqa: BLE001 - at interpreter exit ctypes may be gone: the process frees it all
                pass
            handle.value = None


def package_key() -> bytes:
    """This user's package key: ``private_home()/package.key`` (made on first use: 32 random bytes, ``0600``).

    Refused (``ValueError``) if it is not a regular file of this user's that nobody else can read or write.
    """
    path = os.path.join(trust.private_home(), "package.key")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        fd = None
    if fd is None:
        try:  # O_EXCL: of two processes making it at once, one writes it and the other reads that one
            new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(new, "wb") as f:
                f.write(os.urandom(_KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
        except FileExistsError:
            pass
        fd = os.open(path, flags)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        uid = os.getuid() if hasattr(os, "getuid") else info.st_uid
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
            raise ValueError(f"ft.compile(package=True): the package key {path!r} must be a file of this user's "
                             f"that nobody else can read or write (mode 0o600); it is mode "
                             f"{oct(info.st_mode & 0o7777)}, uid {info.st_uid}. Remove it (packages are rebuilt)")
        key = f.read(_KEY_BYTES + 1)
    if len(key) != _KEY_BYTES:  # (a torn write of another process: it is being made now) read it again once
        import time
        time.sleep(0.1)
        with open(path, "rb") as f:
            key = f.read(_KEY_BYTES + 1)
        if len(key) != _KEY_BYTES:
            raise ValueError(f"ft.compile(package=True): the package key {path!r} is {len(key)} bytes, not "
                             f"{_KEY_BYTES}; remove it (packages are rebuilt)")
    return key


def _sign(key: bytes, material: str, digest: str) -> str:
    return hmac.new(key, json.dumps([material, digest]).encode(), hashlib.sha256).hexdigest()


def _material(gm: torch.fx.GraphModule, inputs: list) -> str:
    device = inputs[0].device if inputs else torch.device("cpu")
    return json.dumps({
        "format": _FORMAT,
        "graph": gm.code,
        "inputs": [[list(t.shape), list(t.stride()), str(t.dtype), str(t.device), t.requires_grad] for t in inputs],
        "device": [device.type, device.index],
        "machine": machine(),
        "functrain": _calling_convention(),
    }, sort_keys=True, default=str)


def _calling_convention() -> str:
    """A hash of the code that decides how a package is called (the capture's input order, the loader)."""
    h = hashlib.sha256()
    for path in (__file__, *(os.path.join(os.path.dirname(__file__), m) for m in ("capture.py", "memory.py"))):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _loader(package: str, device: list, key: str, collective: bool) -> PackageCall:
    if collective and device[0] == "cpu":
        return PackageCall(_FreeRunner(package), key)
    index = -1 if device[0] == "cpu" else (device[1] if device[1] is not None else torch.cuda.current_device())
    return PackageCall(torch._C._aoti.AOTIModelPackageLoader(package, "model", False, 1, index), key)


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
