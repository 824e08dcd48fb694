"""The native kernels of the host's passes (``csrc/host_update.c``): built with the machine's C compiler on
first use, cached per source, flags and CPU, and bound with ctypes (which releases the GIL around each
call). :mod:`~l2l_cli.engine.host_passes` runs them; where they cannot be built or loaded it runs the same
update as torch ops."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from functools import cache
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "host_update.c"
# no FMA the source does not write (the bit-exact match with ATen's fused AdamW), no fast-math; the target is
# this machine's CPU (the library is cached per CPU model and flags)
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC"]


class AdamwArgs(ctypes.Structure):
    """What every element of one update shares (``adamw_args`` in the C source)."""

    _fields_ = [
        ("mult", ctypes.c_float),
        ("has_mult", ctypes.c_int32),
        ("decay", ctypes.c_float),
        ("has_decay", ctypes.c_int32),
        ("lerp_w", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("c2", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("step_size", ctypes.c_float),
    ]


def _cpu_key() -> str:
    """The CPU the library is built for (-march=native): model name and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _cache_dir() -> Path:
    root = os.environ.get("L2L_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "l2l", "kernels"
    )
    return Path(root)


@cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """The native kernels, built on first use (a second or so) and cached; (None, why) where they cannot
    be: no C compiler, a failed build, ``L2L_NATIVE=0``."""
    if os.environ.get("L2L_NATIVE", "1") == "0":
        return None, "L2L_NATIVE=0"
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None or shutil.which(cc) is None:
        return None, "no C compiler found (set CC)"
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *CFLAGS]).encode() + _cpu_key().encode()).hexdigest()[:16]
    for root in (_cache_dir(), Path(tempfile.gettempdir()) / "l2l-kernels"):
        lib = root / f"host_update-{key}.so"
        if not lib.exists():
            try:
                root.mkdir(parents=True, exist_ok=True)
                tmp = root / f".{lib.name}.{os.getpid()}.{threading.get_ident()}"
                run = subprocess.run(
                    [cc, *CFLAGS, "-shared", "-o", str(tmp), str(SOURCE)], capture_output=True, text=True
                )
                if run.returncode != 0:
                    tmp.unlink(missing_ok=True)
                    first = (run.stderr.strip().splitlines() or ["?"])[0]
                    return None, f"{cc} failed: {first}"
                os.replace(tmp, lib)  # atomic: ranks building at once each install a whole library
            except OSError:
                continue  # an unwritable cache: the next place
        try:
            dll = ctypes.CDLL(str(lib))
        except OSError as e:
            return None, f"cannot load {lib}: {e}"
        i64, vp, fp = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p
        dll.l2l_adamw.argtypes = [vp, ctypes.c_int, fp, fp, fp, fp, fp, fp, vp, ctypes.c_int, i64, i64, vp]
        dll.l2l_adamw.restype = None
        dll.l2l_adamw_rows.argtypes = [vp, ctypes.c_int, fp, fp, fp, vp, ctypes.c_int, i64, vp, i64, i64, vp]
        dll.l2l_adamw_rows.restype = None
        dll.l2l_convert.argtypes = [vp, ctypes.c_int, vp, ctypes.c_int, i64, i64]
        dll.l2l_convert.restype = None
        dll.l2l_triad.argtypes = [fp, fp, fp, ctypes.c_float, i64, i64]
        dll.l2l_triad.restype = None
        dll.l2l_adamw8bit.argtypes = [vp, ctypes.c_int, *[vp] * 6, ctypes.c_int, i64, i64, i64, vp, vp, vp]
        dll.l2l_adamw8bit.restype = None
        dll.l2l_qmap_table_bytes.argtypes = []
        dll.l2l_qmap_table_bytes.restype = i64
        dll.l2l_qmap_init.argtypes = [vp, vp, vp]
        dll.l2l_qmap_init.restype = ctypes.c_int
        dll.l2l_quantize.argtypes = [vp, ctypes.c_float, vp, vp, i64]
        dll.l2l_quantize.restype = None
        dll.l2l_dequantize.argtypes = [vp, ctypes.c_float, vp, vp, i64]
        dll.l2l_dequantize.restype = None
        return dll, ""
    return None, "no writable kernel cache"


def native_available() -> tuple[bool, str]:
    """Whether the native kernels load here, and why not."""
    lib, why = library()
    return lib is not None, why
