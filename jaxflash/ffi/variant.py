"""What one compiled binary is: `TensorArg`, `Launch` (a kernel variant) and its key.

Everything here is plain Python and imports no DSL: a machine without ``cutlass`` must form the
same key as the machine that compiled the artifact, or it could never find it.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import io
import json
import os
import re
import tokenize
from typing import Any, Optional

# Bumped whenever the launcher ABI in `compiler.py` changes in a way its source hash would miss.
BRIDGE_ABI = 1

_DTYPES = ("float32", "float16", "bfloat16", "int32", "int8", "uint8", "bool", "int64",
           "float8_e4m3fn", "float8_e5m2")


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """How the kernel sees one XLA buffer (see the interface in `jaxflash.ffi`).

    dtype: numpy dtype name. shape: int = fixed by the variant, None = dynamic (read at run time).
    mode: permutation of the dims presented to the kernel (None = as stored).
    divisibility: per dim, None or a positive int the caller promises divides that dim.
    align: byte alignment the kernel may assume for the data pointer. 16 by default: XLA
        guarantees at least that for every buffer (entry parameters; its own allocations are
        aligned more), and it is what TMA and 128-bit vector accesses need.
    """

    dtype: str
    shape: tuple[Optional[int], ...]
    mode: Optional[tuple[int, ...]] = None
    divisibility: Optional[tuple[Optional[int], ...]] = None
    align: int = 16

    def __post_init__(self):
        object.__setattr__(self, "dtype", str(self.dtype))
        object.__setattr__(self, "shape", tuple(None if d is None else int(d) for d in self.shape))
        if self.dtype not in _DTYPES:
            raise ValueError(f"TensorArg: dtype {self.dtype!r} not in {_DTYPES}")
        if any(d is not None and d < 0 for d in self.shape):
            raise ValueError(f"TensorArg: negative dim in shape {self.shape}")
        n = len(self.shape)
        if self.align not in (1, 2, 4, 8, 16):
            raise ValueError(f"TensorArg: align {self.align} must be a power of two <= 16 "
                             "(more is not guaranteed by XLA)")
        if self.mode is not None:
            mode = tuple(int(m) for m in self.mode)
            if sorted(mode) != list(range(n)):
                raise ValueError(f"TensorArg: mode {mode} is not a permutation of {n} dims")
            object.__setattr__(self, "mode", mode)
        if self.divisibility is not None:
            div = tuple(None if d is None else int(d) for d in self.divisibility)
            if len(div) != n or any(d is not None and d <= 0 for d in div):
                raise ValueError(f"TensorArg: divisibility {div} does not fit shape {self.shape}")
            for s, d in zip(self.shape, div):
                if s is not None and d is not None and s % d:
                    raise ValueError(f"TensorArg: divisibility {d} does not divide fixed dim {s}")
            object.__setattr__(self, "divisibility", div)

    @classmethod
    def like(cls, x, dynamic=(), mode=None, divisibility=None, align=16) -> "TensorArg":
        """The TensorArg of array (or ShapeDtypeStruct) `x` with the dims in `dynamic` left open."""
        dyn = {d % len(x.shape) for d in dynamic}
        return cls(str(x.dtype), tuple(None if i in dyn else int(s) for i, s in enumerate(x.shape)),
                   mode, divisibility, align)

    def describe(self) -> str:
        dims = ",".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]"

    def check(self, x, what: str) -> None:
        """ValueError if array `x` cannot be this buffer."""
        if str(x.dtype) != self.dtype or len(x.shape) != len(self.shape) or any(
                d is not None and d != s for d, s in zip(self.shape, x.shape)):
            raise ValueError(f"{what}: got {x.dtype}{list(x.shape)}, the kernel variant expects "
                             f"{self.describe()}")
        if self.divisibility is not None:
            for i, (s, d) in enumerate(zip(x.shape, self.divisibility)):
                if d is not None and int(s) % d:
                    raise ValueError(f"{what}: dim {i} = {s} is not a multiple of {d} "
                                     f"({x.dtype}{list(x.shape)})")

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape),
                "mode": None if self.mode is None else list(self.mode),
                "divisibility": None if self.divisibility is None else list(self.divisibility),
                "align": self.align}

    @classmethod
    def from_json(cls, d: dict) -> "TensorArg":
        return cls(d["dtype"], tuple(d["shape"]),
                   None if d.get("mode") is None else tuple(d["mode"]),
                   None if d.get("divisibility") is None else tuple(d["divisibility"]),
                   int(d.get("align", 16)))


def _tuplify(v):
    if isinstance(v, list):
        return tuple(_tuplify(x) for x in v)
    return v


def _jsonable(v, where):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return [_jsonable(x, where) for x in v]
    raise TypeError(f"{where}: {v!r} ({type(v).__name__}) is not a JSON value; kernel configs may "
                    "hold only str, int, float, bool, None and tuples of those")


def _ref(obj) -> str:
    return f"{type(obj).__module__}:{type(obj).__qualname__}"


def load_ref(ref: str):
    """Import ``"package.module:Attr"``."""
    mod, _, attr = ref.partition(":")
    if not mod or not attr:
        raise ValueError(f"{ref!r} is not of the form 'package.module:Attr'")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def current_arch() -> str:
    """Target architecture: ``$CUTE_DSL_ARCH`` (as the DSL itself reads it), else the local GPU's,
    else sm_90a. Part of every variant key."""
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    return _local_gpu_arch() or "sm_90a"


@functools.lru_cache(maxsize=1)
def _local_gpu_arch() -> Optional[str]:
    try:
        import jax
        dev = [d for d in jax.devices() if d.platform == "gpu"]
    except Exception:  # no GPU backend at all: that is the CI case, not an error
        return None
    if not dev:
        return None
    cc = getattr(dev[0], "compute_capability", None)
    if not cc:
        return None
    major, _, minor = str(cc).partition(".")
    # The "a" variants carry wgmma/tcgen05; our kernels need them on 9.0 and 10.0.
    suffix = "a" if major in ("9", "10") else ""
    return f"sm_{major}{minor or '0'}{suffix}"


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel variant: everything that determines its binary.

    kernel: ``"module:Class"`` of the kernel class (imported only to compile).
    config: the kernel's frozen config (a dataclass from a DSL-free module).
    inputs / outputs: `TensorArg` per buffer, in the kernel's ``__call__`` order.
    scalars / int_scalars: names of the float32 / int32 runtime scalars.
    arch: e.g. ``"sm_90a"``; None means `current_arch()` at construction.
    """

    kernel: str
    config: Any
    inputs: tuple[TensorArg, ...]
    outputs: tuple[TensorArg, ...]
    scalars: tuple[str, ...] = ()
    int_scalars: tuple[str, ...] = ()
    arch: Optional[str] = None

    def __post_init__(self):
        if ":" not in self.kernel:
            raise ValueError(f"Launch.kernel {self.kernel!r} must be 'package.module:Class'")
        if not dataclasses.is_dataclass(self.config) or isinstance(self.config, type):
            raise TypeError(f"Launch.config must be a dataclass instance, got {self.config!r}")
        hash(self.config)  # frozen and hashable, or this raises
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "scalars", tuple(self.scalars))
        object.__setattr__(self, "int_scalars", tuple(self.int_scalars))
        if not self.outputs:
            raise ValueError("Launch needs at least one output")
        if self.arch is None:
            object.__setattr__(self, "arch", current_arch())
        if not re.fullmatch(r"sm_\d+[a-z]?", self.arch):
            raise ValueError(f"Launch.arch {self.arch!r} is not like 'sm_90a'")

    # -- identity ------------------------------------------------------------------------------
    def config_json(self) -> dict:
        fields = {f.name: _jsonable(getattr(self.config, f.name), f"config field {f.name}")
                  for f in dataclasses.fields(self.config) if f.init}
        return {"class": _ref(self.config), "fields": fields}

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "config": self.config_json(),
                "inputs": [t.to_json() for t in self.inputs],
                "outputs": [t.to_json() for t in self.outputs],
                "scalars": list(self.scalars), "int_scalars": list(self.int_scalars),
                "arch": self.arch}

    def to_json_str(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, d) -> "Launch":
        if isinstance(d, str):
            d = json.loads(d)
        cfg_cls = load_ref(d["config"]["class"])
        cfg = cfg_cls(**{k: _tuplify(v) for k, v in d["config"]["fields"].items()})
        return cls(d["kernel"], cfg, tuple(TensorArg.from_json(t) for t in d["inputs"]),
                   tuple(TensorArg.from_json(t) for t in d["outputs"]),
                   tuple(d.get("scalars", ())), tuple(d.get("int_scalars", ())), d["arch"])

    @property
    def source_hash(self) -> str:
        return source_hash(self.kernel, _ref(self.config))

    @property
    def key(self) -> str:
        """sha256 hex of the variant and the sources that build it (no DSL needed)."""
        h = hashlib.sha256()
        h.update(f"jaxflash-bridge-abi-{BRIDGE_ABI}\n".encode())
        h.update(self.to_json_str().encode())
        h.update(b"\n")
        h.update(self.source_hash.encode())
        build = dsl_build_settings()
        if build:  # (the default build's keys carry nothing here)
            h.update(f"\ndsl-build {build}".encode())
        return h.hexdigest()

    @property
    def name(self) -> str:
        """Readable and unique: ``<Class>-<config key or digest>-<arch>-<key[:16]>``."""
        cls = self.kernel.rpartition(":")[2]
        ck = getattr(self.config, "key", None)
        ck = ck if isinstance(ck, str) else ""
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{cls}-{ck}-{self.arch}" if ck
                      else f"{cls}-{self.arch}")[:120]
        return f"{slug}-{self.key[:16]}"

    def describe(self) -> str:
        ins = ", ".join(t.describe() for t in self.inputs)
        outs = ", ".join(t.describe() for t in self.outputs)
        return (f"{self.kernel} {self.config!r} for {self.arch}: ({ins}) -> ({outs})"
                + (f" scalars {self.scalars}" if self.scalars else "")
                + (f" int scalars {self.int_scalars}" if self.int_scalars else ""))


# -- kernel source hashing --------------------------------------------------------------------
# What is hashed: the code (`code_text`: no comments or docstrings) of the kernel's module,
# every jaxflash.kernels module it imports (transitively, found by parsing import statements,
# never by importing: the DSL may be absent), the config's module, and the bridge's own
# launcher (compiler.py), whose code is compiled into every binary.
# The FP4 kernels compile the Direct-P constants (and their operand prep uses the formats) from
# jaxflash.fp4: those modules are part of their keys too.
_HASHED_PACKAGES = ("jaxflash.kernels", "jaxflash.fp4.constants", "jaxflash.fp4.formats")
_ALWAYS = ("jaxflash.ffi.compiler",)


def _module_file(name: str) -> Optional[str]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return spec.origin


def _imports_of(path: str, modname: str) -> set[str]:
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), path)
    pkg = modname.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in found if m.startswith(_HASHED_PACKAGES)}


def _closure(roots) -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    todo = list(roots)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        path = _module_file(m)
        if path is None:
            continue
        seen[m] = path
        todo.extend(_imports_of(path, m) - set(seen))
    return sorted(seen.items())


def _read_source(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def code_text(source: str) -> str:
    """`source` as the compiler sees it: comments, docstrings, blank lines and trailing blanks
    removed, so that prose edits keep every key while any change of code changes it. Works
    from token and AST positions, which read the same on every Python the project supports
    (hashing an ``ast.dump`` would not: its fields differ between Python versions)."""
    lines = source.splitlines()
    spans = []  # ((row, char col), (row, char col)), rows 1-based

    def chars(row: int, byte_col: int) -> int:  # ast gives UTF-8 byte offsets
        return len(lines[row - 1].encode("utf-8")[:byte_col].decode("utf-8", "ignore"))

    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            spans.append((tok.start, tok.end))
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            d = body[0]
            spans.append(((d.lineno, chars(d.lineno, d.col_offset)),
                          (d.end_lineno, chars(d.end_lineno, d.end_col_offset))))
    for (r0, c0), (r1, c1) in sorted(spans, reverse=True):
        head, tail = lines[r0 - 1][:c0], lines[r1 - 1][c1:]
        lines[r0 - 1:r1] = [head + tail] + [""] * (r1 - r0)
    return "\n".join(line.rstrip() for line in lines if line.strip())


@functools.lru_cache(maxsize=None)
def _hash_files(files: tuple[tuple[str, str, float], ...]) -> str:
    h = hashlib.sha256()
    for mod, path, _mtime in files:
        code = code_text(_read_source(path)).encode("utf-8")
        h.update(mod.encode() + b"\0" + hashlib.sha256(code).digest())
    return h.hexdigest()


def source_files(kernel_ref: str, config_ref: str) -> list[tuple[str, str]]:
    roots = [kernel_ref.partition(":")[0], config_ref.partition(":")[0], *_ALWAYS]
    return _closure(roots)


# DSL settings that change the binary it builds (line info, debug code, assertions, the
# optimization level): a build with one set is another artifact than the default build.
DSL_BUILD_ENV = ("CUTE_DSL_LINEINFO", "CUTE_DSL_DEBUG", "CUTE_DSL_ENABLE_ASSERTIONS",
                 "CUTE_DSL_COMPILER_OPT")


def dsl_build_settings() -> str:
    """The `DSL_BUILD_ENV` settings in effect, '' for the default build."""
    return ";".join(f"{n}={os.environ[n].strip()}" for n in DSL_BUILD_ENV
                    if os.environ.get(n, "").strip() not in ("", "0"))


def source_hash(kernel_ref: str, config_ref: str) -> str:
    """Hash of the source files that build the kernel (see above). mtime keys the memo only."""
    files = source_files(kernel_ref, config_ref)
    if not any(m == kernel_ref.partition(":")[0] for m, _ in files):
        raise ModuleNotFoundError(f"kernel module of {kernel_ref!r} not found")
    return _hash_files(tuple((m, p, os.stat(p).st_mtime_ns) for m, p in files))
