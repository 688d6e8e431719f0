"""Pallas-Triton kernels compiled by the Triton compiler itself, where it is installed.

jax 0.11 hands a pallas_call's Triton IR to XLA, whose bundled Triton pipeline compiles it; for
the flex attention forward that code runs slower on the H100 than the same IR compiled by the
`triton` package (3.6, the compiler torch uses) at some configs and faster at others
(benchmarks/HISTORY.md), so the kernel configs name their compiler. A pallas_call given
`compiler_params(..., compiler="triton")` is lowered to the same Triton IR by Pallas, run
through Triton's IR passes and compiled to PTX by the `triton` package, and launched through
jaxlib's `triton_kernel_call_ffi` custom call (the route jax <= 0.10 and jax-triton take).
Where `triton` is missing, or a kernel would need Triton's global scratch memory, the call falls
back to the stock lowering: same kernel, XLA's compiler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import re
import tempfile
import threading
import zlib

import jax
from jax.experimental.pallas import triton as plgpu

from jattn._src import compat
from jattn._src.tiling import COMPILERS

_PARAM = re.compile(r"\.param\s")
_DOT = re.compile(r"(= tt\.dot [^:\n]*?)( : tensor<)")
_RECORDING = threading.local()  # .kernels: the list `recording_kernels` fills, if any


@dataclasses.dataclass(frozen=True)
class _TritonCompiled(plgpu.CompilerParams):
    """Launch parameters of a kernel that the `triton` package compiles.

    max_num_imprecise_acc: Triton's fp8 dot knob, which Pallas leaves at 0 (set on every dot
    when not None): fp8 products accumulate this many K elements in the tensor core's reduced
    precision before each promotion into the float32 accumulator; 0 promotes after every MMA
    instruction (slow), 2**30 never (Triton's own Hopper default).
    """

    max_num_imprecise_acc: int | None = None


def compiler_params(num_warps: int, num_stages: int, *, compiler: str = "xla",
                    max_num_imprecise_acc: int | None = None):
    """Pallas compiler params for `compiler`: "xla" (jax's stock path) or "triton".

    max_num_imprecise_acc (see _TritonCompiled) needs compiler="triton"; where `triton` is not
    installed the kernel falls back to XLA's compiler and Pallas' 0.
    """
    if compiler not in COMPILERS:
        raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}.")
    if compiler != "triton" and max_num_imprecise_acc is not None:
        raise ValueError("max_num_imprecise_acc takes effect with compiler='triton' only.")
    if compiler == "triton" and _register():
        return _TritonCompiled(num_warps=num_warps, num_stages=num_stages,
                               max_num_imprecise_acc=max_num_imprecise_acc)
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def triton_compiler_available() -> bool:
    """Whether `compiler="triton"` really compiles with the `triton` package here."""
    return _register()


@functools.cache
def _register() -> bool:
    """Installs the lowering rule for `_TritonCompiled`; False where that cannot work."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    jax_internals = compat.pallas_triton_internals()
    if jax_internals is None:
        return False
    jax_internals.pallas_core.register_lowering_rule(
        _TritonCompiled, functools.partial(_lower, jax_internals), "gpu")
    return True


@contextlib.contextmanager
def recording_kernels():
    """Yields a list that receives (compiled kernel, grid) for every kernel this module
    compiles for XLA to launch in lowerings run inside the block on this thread (kernels that
    fall back to XLA's compiler are not recorded)."""
    outer = getattr(_RECORDING, "kernels", None)
    _RECORDING.kernels = kernels = []
    try:
        yield kernels
    finally:
        _RECORDING.kernels = outer


def _gpus() -> list:
    try:
        return jax.local_devices(backend="gpu")
    except RuntimeError:  # no GPU backend on this machine
        return []


def _with_imprecise_acc(ttir: str, value: int) -> str:
    """The IR with maxNumImpreciseAcc = value on every tt.dot (printed only when not 0)."""
    ttir, count = _DOT.subn(rf"\1 {{maxNumImpreciseAcc = {value} : i32}}\2", ttir)
    if count != ttir.count("tt.dot "):
        raise RuntimeError("jattn: could not set maxNumImpreciseAcc on every tt.dot of a "
                           "kernel; the Triton IR format may have changed.")
    return ttir


@functools.cache  # a kernel lowered again (another jit of the same call) compiles once
def _compile(ttir: str, num_warps: int, num_stages: int, capability: int,
             max_num_imprecise_acc: int | None = None):
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", capability, 32)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    backend = make_backend(target)
    # Triton reads IR from a file and writes its path into the IR's locations, and its on-disk
    # cache keys on the IR text: a path named by the kernel's content lets a later process
    # reuse the compiled kernel (a cold compile costs seconds).
    key = hashlib.sha256(f"{ttir}|{num_warps}|{num_stages}|{capability}|"
                         f"{max_num_imprecise_acc}".encode()).hexdigest()
    folder = os.path.join(tempfile.gettempdir(), "jattn-triton-ir")
    os.makedirs(folder, exist_ok=True)
    source, optimized = (os.path.join(folder, f"{key[:32]}{suffix}.ttir")
                         for suffix in ("-in", ""))
    _write(source, ttir)
    # `triton.compile` skips the Triton-IR passes for IR given as a file; without them
    # `acc * alpha + dot(p, v)` keeps the dot's result apart from acc (no rewrite into
    # dot(p, v, acc)), a second [block_q, Ev] float32 tile that spilled at D=128.
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ir.parse_mlir_module(source, context)
    module.context = context
    backend.make_ttir(module, {}, backend.parse_options(options), capability)
    optimized_ir = str(module)
    if max_num_imprecise_acc is not None:
        # After the passes, which fuse `acc + dot(a, b)` into dot(a, b, acc) only while the
        # knob is 0; the fused fp8 dot then promotes its partial sums into acc itself.
        optimized_ir = _with_imprecise_acc(optimized_ir, max_num_imprecise_acc)
    _write(optimized, optimized_ir)
    return triton.compile(optimized, target=target, options=options)


def _write(path: str, text: str) -> None:
    """Writes `text` to `path` atomically (processes may compile the same kernel at once)."""
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(handle, "w") as f:
        f.write(text)
    os.replace(temporary, path)


def _lower(jax_internals, ctx, *in_nodes, jaxpr, compiler_params, grid_mapping,
           input_output_aliases, **params):
    stock, lowering = jax_internals.pallas_call_registration, jax_internals.lowering
    mlir, ir, gpu_triton = jax_internals.mlir, jax_internals.ir, jax_internals.gpu_triton

    plain = plgpu.CompilerParams(num_warps=compiler_params.num_warps,
                                 num_stages=compiler_params.num_stages)

    def fallback():
        return stock.pallas_call_lowering(
            ctx, *in_nodes, jaxpr=jaxpr, compiler_params=plain, grid_mapping=grid_mapping,
            input_output_aliases=input_output_aliases, **params)

    platforms = ctx.platforms or ctx.module_context.platforms
    gpus = _gpus()
    if tuple(platforms) != ("cuda",) or not gpus:
        return fallback()  # e.g. lowering for CUDA on a CPU machine: nothing to compile for
    capability = int(str(gpus[0].compute_capability).replace(".", ""))
    result = lowering.lower_jaxpr_to_triton_module(jaxpr, grid_mapping, "cuda", capability,
                                                   mlir_ctx=ctx.module_context)
    ttir = result.module.operation.get_asm()
    kernel = _compile(ttir, compiler_params.num_warps, compiler_params.num_stages, capability,
                      compiler_params.max_num_imprecise_acc)
    if getattr(kernel.metadata, "global_scratch_size", 0) or getattr(
            kernel.metadata, "profile_scratch_size", 0):
        return fallback()  # would need scratch buffers the launcher does not allocate
    grid = stock.normalize_grid(result.grid)
    if getattr(_RECORDING, "kernels", None) is not None:
        _RECORDING.kernels.append((kernel, grid))
    ptx = kernel.asm["ptx"]
    operands = len(ctx.avals_in) + len(ctx.avals_out)
    entry = ptx[ptx.index(".entry"):]
    extra = len(_PARAM.findall(entry[:entry.index(")")])) - operands  # Triton's scratch pointers
    launch = gpu_triton.TritonKernelCall(
        gpu_triton.TritonKernel(kernel.name, kernel.metadata.num_warps, 1,
                                kernel.metadata.shared, ptx, ttir, capability),
        *grid,
        [gpu_triton.create_array_parameter(0, 16)] * operands
        + [gpu_triton.create_scalar_parameter(0, "u64")] * extra)
    result_types = [mlir.aval_to_ir_type(ctx.module_context, aval) for aval in ctx.avals_out]
    return mlir.custom_call(
        call_target_name="triton_kernel_call_ffi",
        result_types=result_types,
        operands=in_nodes,
        backend_config=dict(
            name=ir.StringAttr.get(kernel.name),
            opaque=ir.StringAttr.get(zlib.compress(launch.to_proto(kernel.name, b""))),
        ),
        operand_layouts=stock.avals_to_layouts(ctx.avals_in),
        result_layouts=stock.avals_to_layouts(ctx.avals_out),
        operand_output_aliases=dict(input_output_aliases),
    ).results
