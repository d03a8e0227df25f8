"""Comparison helpers and the poisoned-margin tensor guard shared by the kernel tests (tests/plugins/,
tests/benchmarks/), the AOT helpers (PTX compiled in a subprocess, PTX launched through the CUDA driver the way
TensorRT's AOT launcher does, a stand-in ``tensorrt.plugin``) and an interpreter of the Gluon MoE's decode PTX."""
import os
import subprocess
import sys
import types
from pathlib import Path

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parents[1]


def benchmark_module(name: str):
    """benchmarks/<name>.py imported as module `name` (the scripts are not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64 on the CPU (any shapes that broadcast equal). AssertionError when a has non-finite
    values (a kernel that read poison or overflowed)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values in kernel output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality with NaN == NaN (poisoned pool regions must stay poisoned)."""
    return torch.equal(torch.nan_to_num(a.cpu().float(), nan=1234.5), torch.nan_to_num(b.cpu().float(), nan=1234.5))


class Guarded:
    """Poisoned memory around every tensor a kernel gets: `g(t)` copies t into the middle of a buffer whose PAD
    elements on each side hold poison (NaN for floats, -1 / 0xFF for integers) and returns that view. An
    out-of-bounds read picks up poison (NaN outputs, or a bad index that faults); `g.check()` asserts no margin
    was written (out-of-bounds stores)."""

    PAD = 256

    def __init__(self):
        self.bufs = []

    @staticmethod
    def _poison(dtype):
        return float("nan") if dtype.is_floating_point else (0xFF if dtype == torch.uint8 else -1)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        buf = torch.full((t.numel() + 2 * self.PAD,), self._poison(t.dtype), dtype=t.dtype, device=t.device)
        view = buf[self.PAD:self.PAD + t.numel()].view(t.shape)
        view.copy_(t)
        self.bufs.append(buf)
        return view

    def empty(self, *shape, dtype, device=DEV) -> torch.Tensor:
        return self(torch.zeros(*shape, dtype=dtype, device=device))

    def check(self):
        for buf in self.bufs:
            for margin in (buf[:self.PAD], buf[-self.PAD:]):
                if buf.dtype.is_floating_point:
                    assert torch.isnan(margin.float()).all(), "a kernel wrote outside its tensor"
                else:
                    assert (margin == self._poison(buf.dtype)).all(), "a kernel wrote outside its tensor"


# ---------------------------------------------------------------- ahead-of-time kernels
# defined for the subprocess snippets: how many parameters kernel `name`'s .entry has in `ptx`
ENTRY_PARAMS = ("import re as _re\n"
                 "def entry_params(name, ptx):\n"
                 "    entry = _re.search(r'\\.entry\\s+' + name + r'\\s*\\(([^)]*)\\)', ptx).group(1)\n"
                 "    return len([p for p in entry.split(',') if p.strip()])\n")


def compile_in_subprocess(code: str) -> list[list[str]]:
    """Run ``code`` in a fresh Python without TRITON_INTERPRET (Triton compiles for real there; ``entry_params(name,
    ptx)`` is defined for it); returns its stdout lines split on whitespace. Fails the test with the subprocess's
    stderr on a non-zero exit."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", ENTRY_PARAMS + code], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return [ln.split() for ln in r.stdout.strip().splitlines()]


class DriverKernel:
    """An AOT kernel's PTX loaded with cuModuleLoadData and launched the way TensorRT's AOT launcher does: every
    argument a pointer (tensor) or an int32 (extra), in the kernel's parameter order, on torch's current stream;
    above 48 KB of static shared memory the function is opted in first. Call ``unload()`` at the end."""

    def __init__(self, name: str, ptx: str, shared: int):
        import ctypes

        self.ct = ctypes
        self.cuda = ctypes.CDLL("libcuda.so.1")
        torch.cuda.current_stream().synchronize()
        self.mod, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        assert self.cuda.cuModuleLoadData(ctypes.byref(self.mod), ctypes.c_char_p(ptx.encode() + b"\0")) == 0
        assert self.cuda.cuModuleGetFunction(ctypes.byref(self.fn), self.mod, name.encode()) == 0
        if shared > 48 * 1024:   # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
            assert self.cuda.cuFuncSetAttribute(self.fn, 8, ctypes.c_int(shared)) == 0

    def params(self, args):
        ct = self.ct
        vals = [ct.c_uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else ct.c_int32(int(a)) for a in args]
        return vals, (ct.c_void_p * len(vals))(*[ct.cast(ct.byref(v), ct.c_void_p) for v in vals])

    def launch(self, lp: dict, packed) -> None:
        """Launch with ``lp`` (launch_params) and ``packed = self.params(args)`` (kept alive by the caller)."""
        stream = self.ct.c_void_p(torch.cuda.current_stream().cuda_stream)
        rc_ = self.cuda.cuLaunchKernel(self.fn, lp["grid_x"], lp["grid_y"], lp["grid_z"], lp["block_x"],
                                       lp["block_y"], lp["block_z"], lp["shared_mem"], stream, packed[1], None)
        assert rc_ == 0, rc_

    def unload(self) -> None:
        self.cuda.cuModuleUnload(self.mod)


class FakeDesc:
    def __init__(self, shape, dtype):
        self.shape_expr, self.dtype, self.alias_of = list(shape), dtype, None

    def aliased(self):
        d = FakeDesc(self.shape_expr, self.dtype)
        d.alias_of = self
        return d


def fake_tensorrt_plugin():
    trt = types.ModuleType("tensorrt")
    trt.float32, trt.float16, trt.bfloat16, trt.int32 = "F32", "F16", "BF16", "I32"
    trtp = types.ModuleType("tensorrt.plugin")
    trtp.defs = {}

    def deco(kind):
        def make(pid):
            def wrap(fn):
                trtp.defs[(kind, pid)] = fn
                return fn
            return wrap
        return make

    for kind in ("register", "autotune", "aot_impl", "impl"):
        setattr(trtp, kind, deco(kind))
    trtp.TensorDesc = FakeDesc
    trtp.from_shape_expr = lambda shape, dtype: FakeDesc(shape, dtype)
    trtp.AutoTuneCombination = lambda s: ("combo", s)

    class KernelLaunchParams:
        pass

    trtp.KernelLaunchParams = KernelLaunchParams
    trtp.SymInt32 = lambda e: ("i32", e)
    trtp.cdiv = lambda a, b: Sym(f"cdiv({getattr(a, 'name', a)},{b})")
    trtp.SymIntExprs = types.SimpleNamespace(from_tuple=lambda xs: ("exprs", list(xs)))
    trt.plugin = trtp
    return trt, trtp


class Sym:
    """A symbolic shape expression for the stand-in tensorrt.plugin: arithmetic stays symbolic (``name`` spells it)."""

    def __init__(self, name):
        self.name = name

    def _op(self, sym, other, swap=False):
        a, b = self.name, getattr(other, "name", other)
        return Sym(f"({b}{sym}{a})" if swap else f"({a}{sym}{b})")

    def __mul__(self, other):
        return self._op("*", other)

    def __rmul__(self, other):
        return self._op("*", other)

    def __add__(self, other):
        return self._op("+", other)

    def __radd__(self, other):
        return self._op("+", other, swap=True)

    def __sub__(self, other):
        return self._op("-", other)

    def __floordiv__(self, other):
        return self._op("//", other)


# ---------------------------------------------------------------- the Gluon MoE decode
def run_decode_ptx(asm: str, word: int, factor_bits: int) -> list[int]:
    """Interpret the integer / bf16x2 PTX of a decode (plugins/moe/kernels_gluon.py `_dq_asm`,
    benchmarks/moe_decode_floor.py `dq_asm14`) on one 32-bit word: mov, and, shl, mul.lo.u32, prmt (mode 0x2301: bytes swapped within each half) and mul.rn.bf16x2
    (products of exact powers of two and E2M1 values: exact in fp32, so rounding never enters). $4 = word,
    $5 = factor bits; returns $0..$3."""
    import re
    import struct

    def bf(b):
        return struct.unpack("<f", struct.pack("<I", (b & 0xFFFF) << 16))[0]

    def to_bf(x):
        b = struct.unpack("<I", struct.pack("<f", x))[0]
        assert b & 0xFFFF == 0, x                 # exactly a bf16
        return b >> 16

    reg = {"$4": word, "$5": factor_bits}
    body = asm.strip()
    assert body.startswith("{") and body.endswith("}"), asm
    for stmt in (x.strip() for x in body[1:-1].split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        m = re.fullmatch(r"([a-z][\w.]*)\s+(.*)", stmt, re.S)
        assert m, f"unparsed PTX statement {stmt!r}"
        op, args = m.group(1), [x.strip() for x in m.group(2).split(",")]
        val = [reg[x] if x in reg else int(x, 0) for x in args[1:]]
        if op == "mov.b32":
            r = val[0]
        elif op == "and.b32":
            r = val[0] & val[1]
        elif op == "shl.b32":
            r = val[0] << val[1]
        elif op == "mul.lo.u32":
            r = val[0] * val[1]
        elif op == "prmt.b32":
            assert val[2] == 0x2301, hex(val[2])
            r = ((val[0] & 0x00FF00FF) << 8) | ((val[0] >> 8) & 0x00FF00FF)
        elif op == "mul.rn.bf16x2":
            r = to_bf(bf(val[0]) * bf(val[1])) | to_bf(bf(val[0] >> 16) * bf(val[1] >> 16)) << 16
        else:
            raise AssertionError(f"unexpected PTX {op}")
        reg[args[0]] = r & 0xFFFFFFFF
    return [reg[f"${i}"] for i in range(4)]

def check_e2m1_decode(asm_of, word_of) -> None:
    """Assert that the decode PTX `asm_of(folded)` on the word `word_of(codes)` of 8 E2M1 codes gives output
    i = (n_i, n_{i+4}) x the E8M0 factor, folded (2^(s-1) factor bits, s <= 128) and not (2^(s-127), after x 2^126),
    exactly and with the sign of zero, for all codes 0..7 in order and 300 random words each way (`run_decode_ptx`)."""
    import math
    import random
    import struct

    e2m1 = [0, .5, 1, 1.5, 2, 3, 4, 6]

    def val(c):
        return (-1.0 if c & 8 else 1.0) * e2m1[c & 7]

    def bf(b):
        return struct.unpack("<f", struct.pack("<I", (b & 0xFFFF) << 16))[0]
    rnd = random.Random(0)
    for folded in (True, False):
        asm = asm_of(folded)
        for trial in range(300):
            codes = [rnd.randrange(16) for _ in range(8)] if trial else list(range(8))
            s = rnd.randrange(100, 129) if folded else rnd.randrange(60, 200)
            fbits = (s * 0x00800080 + (0x3F003F00 if folded else 0)) & 0xFFFFFFFF   # kernels_gluon._scale_bits
            out = run_decode_ptx(asm, word_of(codes), fbits)
            for i in range(4):
                for got, c in ((bf(out[i]), codes[i]), (bf(out[i] >> 16), codes[i + 4])):
                    want = val(c) * 2.0 ** (s - 127)
                    assert got == want and math.copysign(1, got) == math.copysign(1, want), (folded, codes, i)
