"""JSON and YAML read from disk under a memory bound: a crafted file costs at most a few times its size.

Python's parsers turn a few bytes into a large object: ``[],`` (3 bytes) is a list
of 56 bytes plus a pointer, so 32 MiB of nested empty lists cost ~730 MiB; a
339-byte YAML file of nested aliases expands to a tree of millions of nodes when
anything walks it. Before parsing, :func:`loads_json` estimates (from byte counts
of ``[ { , "``, C-speed ``bytes.count``) an upper bound of what the parsed value
will cost in memory and refuses a file whose bound is over ``factor`` times its
size plus ``floor`` bytes; after parsing it refuses nesting deeper than
``max_depth``. :func:`load_yaml` composes the YAML node graph first, refuses any
tag that is not plain data (``!!python/...`` included) and any document whose
alias-expanded node count is over ``max_nodes``, and only then builds the value.

The estimate is an upper bound (measured against CPython 3.11's parser on files
of every shape: empty lists, dicts, floats, ints, short strings, distinct keys):
each ``[`` counts 80 bytes, each ``{`` 200, each comma 48 (a pointer plus the
largest small scalar: a float, an int), each quote 48 (half a short string),
plus the text's own size for string contents. The files functrain writes
estimate at: ``extra.json`` with the packed metric history about 1 times its
size, ``tree.json`` about 17 (its format of one small dict per node costs ~8
times its size for real), so ``tree.json`` is read with a factor of
:data:`TREE_FACTOR` (32) and a size cap of 64 MiB; the small files (completion
marks, locks, configs) fit in the floor.

Example::

    >>> from functrain.checkpoint.bounded import loads_json
    >>> loads_json(b'{"epoch": 3}', "extra.json")
    {'epoch': 3}
    >>> loads_json(b"[" + b",".join([b"[]"] * 10**6) + b"]", "extra.json", floor=0)
    Traceback (most recent call last):
    ...
    ValueError: extra.json: parsing its 3000001 bytes would cost up to 124.9 MiB of memory (limit 4 x its size + 0 bytes): refused as a crafted file (nested empty containers?)
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["FACTOR", "FLOOR", "TREE_FACTOR", "MAX_DEPTH", "estimate", "loads_json", "load_yaml", "json_factor"]

FACTOR = 4  # a parse may cost this many times the file's size ...
FLOOR = 64 << 20  # ... plus this many bytes (small files are never refused)
TREE_FACTOR = 32  # tree.json: see the module doc
MAX_DEPTH = 128  # nesting levels (a checkpoint's tree.json nests ~3 per pytree level)
_ENV = "FUNCTRAIN_JSON_FACTOR"  # raise the factor for an old checkpoint (a long unpacked metric history)


def json_factor() -> float:
    """The memory factor in force: :data:`FACTOR`, or ``$FUNCTRAIN_JSON_FACTOR`` (a number >= 1) if set."""
    raw = os.environ.get(_ENV)
    if not raw:
        return FACTOR
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 1 or value == float("inf"):
        raise ValueError(f"${_ENV} must be a finite number >= 1 (the memory factor of a JSON parse); got {raw!r}")
    return value


def estimate(data: bytes | str) -> int:
    """An upper bound of the bytes that ``json.loads(data)`` allocates for its value (see the module doc).

    ASCII bytes, or a ``str`` (whose size in memory is known: 1, 2 or 4 bytes per character).
    """
    if isinstance(data, str):
        text_bytes, count = sys.getsizeof(data), data.count
        lists, dicts, commas, quotes = count("["), count("{"), count(","), count('"')
    else:
        text_bytes = len(data) if data.isascii() else 4 * len(data)
        lists, dicts = data.count(b"["), data.count(b"{")
        commas, quotes = data.count(b","), data.count(b'"')
    return text_bytes + 80 * lists + 200 * dicts + 48 * commas + 48 * quotes + 1024


def _too_deep(value: Any, max_depth: int) -> bool:
    stack = [(value, 1)]
    while stack:
        x, d = stack.pop()
        if d > max_depth:
            return True
        if isinstance(x, dict):
            stack.extend((v, d + 1) for v in x.values() if isinstance(v, (dict, list)))
        elif isinstance(x, list):
            stack.extend((v, d + 1) for v in x if isinstance(v, (dict, list)))
    return False


def loads_json(data: bytes | str, where: str, *, factor: float | None = None, floor: int = FLOOR,
               max_depth: int = MAX_DEPTH, error: type[Exception] = ValueError) -> Any:
    """``json.loads(data)`` if its memory bound is at most ``factor * len(data) + floor`` and it nests at most
    ``max_depth`` levels; otherwise (or for invalid JSON) ``error`` naming ``where`` and why.

    ``factor`` defaults to :func:`json_factor` (4).
    """
    factor = json_factor() if factor is None else factor
    size = len(data)
    if isinstance(data, (bytes, bytearray)) and not data.isascii():  # its str's size is then known exactly
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{where}: not valid JSON (UnicodeDecodeError: {str(e)[:200]})") from None
    cost = estimate(data)
    if cost > factor * size + floor:
        raise error(f"{where}: parsing its {size} bytes would cost up to {cost / 2**20:.1f} MiB of memory (limit "
                    f"{factor:g} x its size + {floor} bytes): refused as a crafted file (nested empty "
                    f"containers?)")
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(f"{where}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if isinstance(value, (dict, list)) and _too_deep(value, max_depth):
        raise error(f"{where}: nests deeper than {max_depth} levels: refused")
    return value


# -------------------------------------------------------------------------------------- YAML
# plain data only: what yaml.safe_dump writes for str, int, float, bool, None, lists and dicts
_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map")}


def load_yaml(text: str, where: str, *, max_nodes: int = 10_000, error: type[Exception] = ValueError) -> Any:
    """``yaml.safe_load(text)`` for plain data, its aliases bounded: at most ``max_nodes`` nodes once every
    alias is expanded, no recursive alias, only the tags of str, int, float, bool, null, lists and maps
    (``!!python/object/apply:...`` and every other tag is refused, naming it and its line); else ``error``.
    """
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as e:
            raise error(f"{where}: not valid YAML ({str(e)[:300]})") from None
        if node is None:
            return None
        _check_nodes(node, where, max_nodes, error)
        try:
            return loader.construct_document(node)
        except yaml.YAMLError as e:
            raise error(f"{where}: {str(e)[:300]}") from None
    finally:
        loader.dispose()


def _check_nodes(root: Any, where: str, max_nodes: int, error: type[Exception]) -> None:
    """Count the nodes of the alias-expanded document (an alias to a node counts that node's whole size
    again), refuse cycles and tags that are not plain data. Each distinct node is visited once."""
    import yaml

    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            children = _children(node)
            total = 1 + sum(size[id(c)] for c in children)
            if total > max_nodes:
                raise error(f"{where}: the document expands to more than {max_nodes} values (nested aliases?): "
                            f"refused")
            size[key] = total
            continue
        if key in size:
            continue
        if key in on_path:
            raise error(f"{where}: line {node.start_mark.line + 1}: a recursive alias: refused")
        if node.tag not in _PLAIN_TAGS:
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise error(f"{where}: line {node.start_mark.line + 1}: the tag {tag[:100]!r} is not allowed: a config "
                        f"holds plain data only (strings, numbers, booleans, null, lists and maps); nothing in it "
                        f"is ever constructed as a Python object")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)
        if not isinstance(node, (yaml.ScalarNode, yaml.SequenceNode, yaml.MappingNode)):  # pragma: no cover
            raise error(f"{where}: an unknown YAML node {type(node).__name__}")


def _children(node: Any) -> list:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [x for kv in node.value for x in kv]
    return []
