"""The one place tensors cross between torch and JAX: DLPack, zero-copy both ways.

What is shared rather than copied: a contiguous tensor's memory becomes a JAX array's buffer
(same address) and a JAX result becomes a torch tensor on the same buffer. The exceptions are
explicit: a non-contiguous tensor is made contiguous first (one copy), int64 becomes int32 unless
JAX runs with x64 enabled (one copy; JAX's default integer is 32-bit), and a tensor whose address
is not aligned as XLA requires (e.g. a view at an odd offset) is copied: by JAX's CPU backend, by
`to_jax` on CUDA.

Streams on the GPU (measured on the H100, jax 0.11): JAX's runtime runs kernels on its own
compute stream and ignores the stream a DLPack import names (tested: neither that stream nor the
one JAX reports for external events orders its kernels). `wait_for_torch` therefore records an
event on torch's current stream and has JAX's compute stream wait for it (cuStreamWaitEvent;
the stream handle is read once from inside a JAX program): the GPU waits, the host does not,
so back-to-back ops still queue ahead of the GPU. Results cross back ordered on torch's
current stream, so later torch work waits on the GPU for our kernel. A JAX view keeps its
DLPack capsule, hence the torch storage, alive until JAX is done with it.

Views are cached per tensor object while it lives and keeps its address, shape, strides, dtype
and device (an in-place `transpose_` or `set_` changes one of them): a weight, a BlockMask list
or a captured table crosses once, not on every call. Only views that share the tensor's memory
are cached, so in-place writes to the tensor are what the view reads; the version counter need
not be part of the key.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import threading
import weakref
from collections.abc import Sequence

import jax
import jax.dlpack
import jax.numpy as jnp
import torch
import torch.utils.dlpack
from jax.experimental.buffer_callback import buffer_callback

from jattn._src import bridge

# jaxlib's capsule calls, without jax.dlpack's per-tensor host synchronisation (or None)
_import_capsule, _export_capsule = bridge.compat.dlpack_capsule_functions()
_current_device, _current_stream = bridge.compat.torch_cuda_device_and_stream()
_from_capsule = bridge.compat.torch_from_dlpack_capsule()

_DL_DEVICE_TYPES = {"cpu": 1, "cuda": 2}  # DLDeviceType kDLCPU, kDLCUDA

# torch dtype -> JAX dtype, for every dtype that crosses.
DTYPES = {
    torch.bfloat16: jnp.bfloat16,
    torch.float16: jnp.float16,
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,  # flex_attention on the CPU, in JAX's x64 mode (`x64_scope`)
    torch.int8: jnp.int8,  # mixed_matmul's int8 weights
    torch.uint8: jnp.uint8,  # its packed int4 weights
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.bool: jnp.bool_,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
}

_WIDENED = (torch.int64, torch.float64)  # the dtypes of DTYPES that JAX narrows without x64
_XLA_GPU_ALIGNMENT = 16  # bytes; "Address of buffer 1 must be a multiple of 10" (hex) otherwise

# id(tensor) -> ((address, shape, dtype), view, weak reference whose callback drops the entry
# when its tensor dies). (Not a WeakKeyDictionary: its key comparisons would call torch's
# elementwise ==; not weakref.finalize: ~10 us per new tensor, a weakref with a callback ~0.5.)
_VIEWS: dict[int, tuple] = {}


bridge.register_cache("torch.views", _VIEWS.clear)


@atexit.register
def _keep_views_past_exit() -> None:
    """Holds the cached views for good once the program exits. A view released while an XLA
    computation still reads it is freed later by one of XLA's threads, which then takes the
    GIL to free the Python object torch keeps for the view's tensor (seen on the CPU: a
    weakref callback on that object runs on XLA's thread). During interpreter finalization
    Python ends such a thread inside C++ frames that cannot unwind: the process aborts
    ("terminate called without an active exception"). Views never released are never freed
    then; the exit returns their memory."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object([entry[1] for entry in _VIEWS.values()]))


@functools.cache  # on every import: look the device up once
def _jax_device(platform: str, index: int) -> jax.Device:
    backend = "gpu" if platform == "cuda" else platform
    for device in jax.local_devices(backend=backend):
        if device.local_hardware_id == index:
            return device
    raise ValueError(f"JAX sees no {platform} device with index {index}.")


def _import(tensor: torch.Tensor, device: torch.device) -> jax.Array:
    """The capsule call `jax.dlpack.from_dlpack` wraps (~5 us against its ~70: it also asks for
    a stream JAX then ignores, and host-waits for it on CUDA). On the CPU it copies a tensor
    whose address XLA finds misaligned. device: the tensor's."""
    if _import_capsule is None:
        return jax.dlpack.from_dlpack(tensor)
    jax_device = _jax_device(device.type, device.index or 0)
    capsule = torch.utils.dlpack.to_dlpack(tensor)
    try:
        return _import_capsule(capsule, jax_device, None, None, _DL_DEVICE_TYPES[device.type])
    except TypeError:  # jaxlib without the device-type argument
        return _import_capsule(capsule, jax_device, None, None)


def _forget(key: int, views: dict = _VIEWS):
    """The callback that drops a dead tensor's entry (the dict bound now: at interpreter exit
    the module's globals are cleared before the last tensors die)."""
    return lambda _: views.pop(key, None)


def to_jax(tensor: torch.Tensor, name: str) -> jax.Array:
    """A JAX array on the same device and memory as `tensor` (detached from autograd).

    name: the argument's name, for errors. On CUDA, call `wait_for_torch` once before the
    computation that reads the arrays.
    """
    cached = _VIEWS.get(id(tensor))
    if cached is not None and cached[0] == _signature(tensor):
        return cached[1]  # validated when cached
    if not isinstance(tensor, torch.Tensor):
        raise _not_a_tensor(name, tensor)
    if tensor.dtype not in DTYPES or (tensor.dtype == torch.float64
                                      and not jax.config.jax_enable_x64):
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPES
                              if d != torch.float64)
        raise TypeError(f"`{name}` has dtype {tensor.dtype}; supported: {supported} (and "
                        "float64 for flex_attention).")
    device = tensor.device
    if device.type == "meta":  # shapes only: the op evaluates abstractly (`run`)
        return jax.ShapeDtypeStruct(tuple(tensor.shape), DTYPES[narrowed(tensor).dtype])
    if device.type not in _DL_DEVICE_TYPES:
        raise ValueError(f"`{name}` is on {device}; jattn runs on CPU and CUDA tensors (and "
                         "infers shapes on meta tensors).")
    # Always a detached alias: a capsule of `tensor` itself would keep its Python object alive
    # (torch preserves it while the C++ tensor is referenced), so the cache would never let go.
    source = narrowed(tensor.detach())
    if not source.is_contiguous():
        source = source.contiguous()  # the one documented copy
    elif device.type == "cuda" and source.data_ptr() % _XLA_GPU_ALIGNMENT:
        source = source.clone()  # XLA's GPU runtime rejects the buffer at run time
    array = _import(source, device)
    # A view, not a copy, is reusable; except a 64-bit one: it is a view only in x64 mode.
    if array.unsafe_buffer_pointer() == tensor.data_ptr() and tensor.dtype not in _WIDENED:
        key = id(tensor)
        _VIEWS[key] = (_signature(tensor), array, weakref.ref(tensor, _forget(key)))
    return array


def narrowed(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor a mod reads in a dtype JAX keeps: int64 as int32 and float64 as float32 unless
    JAX runs with x64 (its default integer is 32-bit, and a float32 call's mods compute in
    float32), int16 as int32; converted by torch: a torch kernel costs a few
    microseconds, JAX's eager conversion ~0.2 ms (H100). int64 values beyond int32 raise
    (`_check_fits_int32`) rather than wrap."""
    if tensor.dtype == torch.int64 and not jax.config.jax_enable_x64:
        if not torch.compiler.is_compiling():
            _check_fits_int32(tensor)
        return tensor.to(torch.int32)
    if tensor.dtype == torch.float64 and not jax.config.jax_enable_x64:
        return tensor.to(torch.float32)  # (a float32 call's mods compute in float32)
    if tensor.dtype == torch.int16:
        return tensor.to(torch.int32)  # (exact)
    return tensor


# int64 tensors found to fit in int32, at the version (in-place edits) they were checked at:
# a CUDA tensor's check waits for the device, so a tensor read again is not checked again.
_FITS_INT32: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INT32 = torch.iinfo(torch.int32)


def _check_fits_int32(tensor: torch.Tensor) -> None:
    """Raises ValueError where an int64 tensor a mod reads holds a value int32 cannot (a
    timestamp, a hash): narrowed, it would compare and compute wrongly without a sign."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return
    if tensor.device.type != "cpu" and _FITS_INT32.get(tensor) == tensor._version:
        return
    low, high = (int(x) for x in torch.aminmax(tensor.detach()))
    if low < _INT32.min or high > _INT32.max:
        raise ValueError(
            f"a tensor a mod reads holds int64 values in [{low}, {high}], beyond int32: jattn "
            "computes a mod's integers in int32 (JAX's default), where they would wrap. "
            "Subtract a base first (`ts - ts.min()`).")
    if tensor.device.type != "cpu":
        _FITS_INT32[tensor] = tensor._version


def x64_scope(*tensors):
    """JAX's x64 mode where a tensor is float64 (flex_attention computes it in float64 on the
    xla implementation), else no change. While torch.compile traces, no change: JAX runs
    inside the ops then (which take the scope themselves), and Dynamo cannot trace JAX's
    switch."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    if any(getattr(t, "dtype", None) in (torch.float64, jnp.float64) for t in tensors):
        return jax.enable_x64(True)
    return contextlib.nullcontext()


def _signature(tensor: torch.Tensor) -> tuple:
    """What a cached view must still match: address, shape, strides, dtype and device index
    (-1: the CPU; an int compares faster than a torch.device)."""
    return (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype,
            tensor.get_device())


@functools.cache
def _driver() -> tuple:
    """(cuEventRecord, cuStreamWaitEvent) from the CUDA driver: a call each, ~1 us."""
    library = ctypes.CDLL("libcuda.so.1")
    functions = library.cuEventRecord, library.cuStreamWaitEvent
    functions[0].argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    functions[1].argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    return functions


@functools.cache
def _jax_compute_stream(index: int) -> int:
    """The CUDA stream JAX's programs run on, on GPU `index`: read once from inside a program
    (a buffer_callback is handed XLA's compute stream)."""
    seen = []
    program = jax.jit(buffer_callback(lambda ctx, out: seen.append(ctx.stream),
                                      jax.ShapeDtypeStruct((), jnp.int8)),
                      out_shardings=jax.sharding.SingleDeviceSharding(_jax_device("cuda", index)))
    jax.block_until_ready(program())
    return seen[0]


# Per thread, per GPU index: (torch.cuda.Event, its CUDA event handle, JAX's compute stream),
# reused: a wait takes the event's state when it is queued, and a thread's record and wait are
# not interleaved with another thread's.
_THREAD = threading.local()


def _recorded_by_torch(index: int) -> tuple:
    """The thread's event for GPU `index`, recorded on torch's current stream by torch."""
    handles = _THREAD.__dict__.get(index)
    if handles is None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(index))  # creates the CUDA event
        handles = _THREAD.__dict__[index] = (event, event.cuda_event, _jax_compute_stream(index))
    else:
        handles[0].record(torch.cuda.current_stream(index))
    return handles


def wait_for_torch(device: torch.device) -> None:
    """Before JAX reads CUDA tensors: JAX's compute stream on `device` waits (on the GPU) for
    the work queued so far on torch's current stream. Call once per op, before its program."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    record, wait = _driver()
    # The driver's record on torch's raw stream handle costs ~1 us against ~4 for torch's
    # Stream object and record (ops call this on every call). Torch's record instead: before
    # the thread's first (torch creates the CUDA event then), for the default stream (handle 0)
    # of another device than the current one (0 names the current context's), and where the
    # driver's fails, as on a thread with no current CUDA context (autograd runs backward on
    # its own threads; torch's record makes the context current).
    handles = _THREAD.__dict__.get(index)
    stream = _current_stream(index)
    if (handles is None or (stream == 0 and _current_device() != index)
            or record(handles[1], stream)):
        handles = _recorded_by_torch(index)
    status = wait(handles[2], handles[1], 0)
    if status:
        raise RuntimeError(f"cuStreamWaitEvent failed with CUDA error {status}.")


def run(program, device: torch.device, *args):
    """program(*args) on the JAX views of tensors on `device`; on meta tensors (views that are
    shapes) its abstract evaluation: jattn's checks run and the result's shapes come back,
    as torch ops infer shapes on meta tensors, with nothing computed."""
    if device.type == "meta":
        return jax.eval_shape(program, *args)
    return program(*args)


# JAX dtype -> torch dtype, for results (64-bit ints come back as JAX computed them).
_TORCH_DTYPES = {jnp.dtype(jax_dtype): torch_dtype for torch_dtype, jax_dtype in DTYPES.items()
                 if torch_dtype not in _WIDENED}


def to_torch(array: jax.Array, device: torch.device | None = None) -> torch.Tensor:
    """A torch tensor on the same device and memory as `array`; on the GPU, work queued later
    on torch's current stream waits for the computation that produces it. device: the array's
    as a torch device, which the ops pass (reading it from the array costs ~2 us). An abstract
    result (`run` on meta tensors) becomes an empty meta tensor of its shape and dtype."""
    if isinstance(array, jax.ShapeDtypeStruct):
        return torch.empty(array.shape, dtype=_TORCH_DTYPES[jnp.dtype(array.dtype)],
                           device="meta")
    if _export_capsule is None:
        return torch.from_dlpack(array)
    if device is None:
        jax_device = array.device
        cuda, index = jax_device.platform == "gpu", jax_device.local_hardware_id
    else:
        cuda, index = device.type == "cuda", device.index or 0
    stream = _current_stream(index) if cuda else None
    return _from_capsule(_export_capsule(array, stream))


def same_device(fn: str, **tensors: torch.Tensor | None) -> torch.device:
    """The one device all given tensors (None skipped) are on, else a clear error."""
    devices = {t.device for t in tensors.values() if t is not None}
    if len(devices) > 1:
        raise _device_error(fn, list(tensors.values()), list(tensors))
    return devices.pop()


def jax_views(fn: str, tensors: Sequence[torch.Tensor | jax.Array | None],
              names: Sequence[str]) -> tuple[torch.device, list[jax.Array | None]]:
    """The one device the torch tensors are on (else a clear error) and their JAX views
    (`to_jax`; JAX arrays, their shapes on meta, and None pass through), in one pass: ops
    call it on every call. names: the tensors' argument names, for errors."""
    first, arrays = None, []
    for tensor, name in zip(tensors, names):
        # The common case first, inline: a tensor whose view is cached (a live entry's id is
        # that tensor's, so a match needs no type check).
        cached = _VIEWS.get(id(tensor))
        if cached is not None and cached[0] == (signature := _signature(tensor)):
            array = cached[1]
        elif isinstance(tensor, torch.Tensor):
            if first is not None and tensor.device != first.device:  # before to_jax's errors
                raise _device_error(fn, tensors, names)
            array, signature = to_jax(tensor, name), _signature(tensor)
        elif tensor is None or isinstance(tensor, (jax.Array, jax.ShapeDtypeStruct)):
            arrays.append(tensor)
            continue
        else:
            raise _not_a_tensor(name, tensor)
        if first is None:
            first, where = tensor, signature[4]
        elif signature[4] != where:  # device indices of tensors with cached views
            raise _device_error(fn, tensors, names)
        arrays.append(array)
    return None if first is None else first.device, arrays


def _not_a_tensor(name: str, value) -> TypeError:
    return TypeError(f"`{name}` must be a torch.Tensor, got {type(value).__name__}.")


def _device_error(fn: str, tensors: Sequence, names: Sequence[str]) -> ValueError:
    seen = ", ".join(f"{name} on {t.device}" for t, name in zip(tensors, names)
                     if isinstance(t, torch.Tensor))
    return ValueError(f"{fn}: all tensors must be on one device, got {seen}.")
