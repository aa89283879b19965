"""ctypes bindings of the device libraries for the CPython flavor of a rank:
the same calls, with the same real C signatures, as src/device_*.c.

NvidiaDevice: libcudart.so.12, libnccl.so.2, libcupti.so.12; libcuda.so.1
for what libraries do straight through the driver (driver launches, graphs,
expandable segments).
AscendDevice: libascendcl.so, libhccl.so, libmspti.so; libruntime.so for
what operator libraries do straight through the CANN runtime.
Each method returns the library's status code (0 = success).
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from ctypes import (CFUNCTYPE, POINTER, Structure, byref, c_char, c_char_p, c_int, c_size_t,
                    c_uint, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p)
from dataclasses import dataclass

KERNEL_MAGIC = 0x4E524B53  # standin_kernel.h: the bytes "SKRN"
KERNEL_SLEEP = 0
ACTIVITY_BUFFER_BYTES = 256 * 1024


class KernelSpec(Structure):
    """struct standin_kernel_spec (standin_kernel.h)."""

    _fields_ = [("magic", c_uint32), ("mode", c_uint32), ("duration_ns", c_uint64)]


class Dim3(Structure):
    _fields_ = [("x", c_uint), ("y", c_uint), ("z", c_uint)]


class CuLaunchConfig(Structure):
    """CUlaunchConfig (standin_cu.h)."""

    _fields_ = [("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint),
                ("blockDimX", c_uint), ("blockDimY", c_uint), ("blockDimZ", c_uint),
                ("sharedMemBytes", c_uint), ("hStream", c_void_p), ("attrs", c_void_p),
                ("numAttrs", c_uint)]


class CuKernelNodeParams(Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (standin_cu.h)."""

    _fields_ = [("func", c_void_p), ("gridDimX", c_uint), ("gridDimY", c_uint),
                ("gridDimZ", c_uint), ("blockDimX", c_uint), ("blockDimY", c_uint),
                ("blockDimZ", c_uint), ("sharedMemBytes", c_uint),
                ("kernelParams", POINTER(c_void_p)), ("extra", POINTER(c_void_p)),
                ("kern", c_void_p), ("ctx", c_void_p)]


class CuMemLocation(Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class CuMemAllocationProp(Structure):
    """CUmemAllocationProp (standin_cu.h)."""

    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", CuMemLocation),
                ("win32HandleMetaData", c_void_p), ("allocFlags", c_uint8 * 8)]


class CuMemAccessDesc(Structure):
    _fields_ = [("location", CuMemLocation), ("flags", c_int)]


class RtArgsEx(Structure):
    """rtArgsEx_t (standin_rt.h)."""

    _fields_ = [("args", c_void_p), ("hostInputInfoPtr", c_void_p), ("argsSize", c_uint32),
                ("tilingAddrOffset", c_uint32), ("tilingDataOffset", c_uint32),
                ("hostInputInfoNum", c_uint16), ("hasTiling", c_uint8),
                ("isNoNeedH2DCopy", c_uint8), ("reserved", c_uint8 * 4)]


@dataclass
class DriverKernel:
    """A kernel launched straight through the layer below the runtime (as
    struct sim_driver_kernel, src/device.h): its handle is got at its first
    launch; `library` gets it through the library API (cuLibraryGetKernel +
    cuKernelGetFunction; on Ascend, found again by rtGetFunctionByName),
    `ex` launches with cuLaunchKernelEx (rtKernelLaunchWithFlag) instead of
    cuLaunchKernel (rtKernelLaunch)."""

    name: str
    library: bool = False
    ex: bool = False
    handle: int | None = None


def _spec_params(duration_ns: int) -> tuple[KernelSpec, ctypes.Array]:
    """A sleep kernel's spec and the kernelParams array pointing at it (keep
    both alive until the call returns; the library copies the spec)."""
    spec = KernelSpec(KERNEL_MAGIC, KERNEL_SLEEP, duration_ns)
    return spec, (c_void_p * 1)(ctypes.addressof(spec))


class NcclUniqueId(Structure):
    _fields_ = [("internal", c_char * 128)]


class HcclRootInfo(Structure):
    _fields_ = [("internal", c_char * 4108)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.aligned_alloc.restype = c_void_p
_libc.aligned_alloc.argtypes = [c_size_t, c_size_t]
_libc.free.argtypes = [c_void_p]


def _load(lib_dir: str | None, soname: str) -> ctypes.CDLL:
    path = os.path.join(lib_dir, soname) if lib_dir else soname
    return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def _sig(lib, name, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


def _u32(addr: int, off: int) -> int:
    return c_uint32.from_address(addr + off).value


def _u64(addr: int, off: int) -> int:
    return c_uint64.from_address(addr + off).value


def _cstr(ptr: int) -> str | None:
    return ctypes.string_at(ptr).decode(errors="replace") if ptr else None


def _record(kind: str, raw_kind: int, start: int, end: int, **fields) -> dict:
    """One activity-log line, as src/steplog.c writes it (absent fields left out)."""
    return {"kind": kind, "raw_kind": raw_kind, "start": start, "end": end,
            **{k: v for k, v in fields.items() if v is not None}}


def _cupti_record(r: int) -> dict:
    """Offsets of standin_cupti.h (CUDA 12.9 layouts)."""
    kind = _u32(r, 0)
    if kind in (3, 10):  # KERNEL, CONCURRENT_KERNEL (CUpti_ActivityKernel9)
        return _record("kernel", kind, _u64(r, 16), _u64(r, 24), device=_u32(r, 40),
                       stream=_u32(r, 48), correlation=_u32(r, 92), name=_cstr(_u64(r, 104)))
    if kind == 1:  # MEMCPY (CUpti_ActivityMemcpy6)
        return _record("memcpy", kind, _u64(r, 16), _u64(r, 24), device=_u32(r, 32),
                       stream=_u32(r, 40), correlation=_u32(r, 44), bytes=_u64(r, 8))
    if kind in (4, 5):  # DRIVER, RUNTIME (CUpti_ActivityAPI)
        return _record("api", kind, _u64(r, 8), _u64(r, 16), correlation=_u32(r, 32),
                       pid=_u32(r, 24), tid=_u32(r, 28), cbid=_u32(r, 4))
    return _record("other", kind, 0, 0)


def _mspti_record(r: int) -> dict:
    """Offsets of standin_mspti.h (packed CANN 8 layouts)."""
    kind = _u32(r, 0)
    if kind == 2:  # KERNEL
        return _record("kernel", kind, _u64(r, 4), _u64(r, 12), device=_u32(r, 20),
                       stream=_u32(r, 24), correlation=_u64(r, 28), name=_cstr(_u64(r, 44)))
    if kind == 3:  # API
        return _record("api", kind, _u64(r, 4), _u64(r, 12), correlation=_u64(r, 28),
                       pid=_u32(r, 20), tid=_u32(r, 24), name=_cstr(_u64(r, 36)))
    if kind == 4:  # HCCL
        return _record("hccl", kind, _u64(r, 4), _u64(r, 12), device=_u32(r, 20),
                       stream=_u32(r, 24), name=_cstr(_u64(r, 36)))
    if kind == 9:  # COMMUNICATION
        return _record("communication", kind, _u64(r, 24), _u64(r, 32), device=_u32(r, 16),
                       stream=_u32(r, 20), correlation=_u64(r, 64), name=_cstr(_u64(r, 48)))
    if kind == 1:  # MARKER
        ts = _u64(r, 12)
        return _record("marker", kind, ts, ts, name=_cstr(_u64(r, 36)))
    return _record("other", kind, 0, 0)


class _ActivityCounter:
    """Counts records read back with *ActivityGetNextRecord from the
    buffers the activity library hands back (possibly on its own thread),
    and with an activity log, writes each one there (decoded by `decode`)."""

    def __init__(self, get_next, decode):
        self.get_next = get_next
        self.decode = decode
        self.lock = threading.Lock()
        self.count = 0
        self.log = None

    def open_log(self, path: str) -> None:
        self.log = open(path, "w")

    def request(self, buf, size, max_records):
        ptr = _libc.aligned_alloc(8, ACTIVITY_BUFFER_BYTES)
        buf[0] = ctypes.cast(ptr, POINTER(c_uint8))
        size[0] = ACTIVITY_BUFFER_BYTES if ptr else 0
        max_records[0] = 0

    def complete(self, buf, valid):
        record = c_void_p()
        n = 0
        lines = []
        if buf and valid:
            while self.get_next(buf, valid, byref(record)) == 0:
                n += 1
                if self.log:
                    lines.append(json.dumps(self.decode(record.value)) + "\n")
        with self.lock:
            self.count += n
            if self.log:
                self.log.writelines(lines)
        _libc.free(ctypes.cast(buf, c_void_p))

    def take(self) -> int:
        with self.lock:
            n, self.count = self.count, 0
            if self.log:
                self.log.flush()
        return n


class NvidiaDevice:
    flavor = "nvidia"
    OOM = 2  # cudaErrorMemoryAllocation
    ID_TYPE = NcclUniqueId
    FLOAT32, SUM = 7, 0

    def __init__(self, lib_dir: str | None):
        self.lib_dir = lib_dir
        rt = _load(lib_dir, "libcudart.so.12")
        nccl = _load(lib_dir, "libnccl.so.2")
        cupti = _load(lib_dir, "libcupti.so.12")
        vp = c_void_p
        self.cudaGetDeviceCount = _sig(rt, "cudaGetDeviceCount", c_int, POINTER(c_int))
        self.cudaSetDevice = _sig(rt, "cudaSetDevice", c_int, c_int)
        self.cudaStreamCreateWithFlags = _sig(rt, "cudaStreamCreateWithFlags", c_int,
                                              POINTER(vp), c_uint)
        self.cudaStreamSynchronize = _sig(rt, "cudaStreamSynchronize", c_int, vp)
        self.cudaMalloc = _sig(rt, "cudaMalloc", c_int, POINTER(vp), c_size_t)
        self.cudaMemcpyAsync = _sig(rt, "cudaMemcpyAsync", c_int, vp, vp, c_size_t, c_int, vp)
        self.cudaLaunchKernel = _sig(rt, "cudaLaunchKernel", c_int, vp, Dim3, Dim3,
                                     POINTER(vp), c_size_t, vp)
        self.registerFatBinary = _sig(rt, "__cudaRegisterFatBinary", POINTER(vp), vp)
        self.registerFatBinaryEnd = _sig(rt, "__cudaRegisterFatBinaryEnd", None, POINTER(vp))
        self.registerFunction = _sig(rt, "__cudaRegisterFunction", None, POINTER(vp), vp,
                                     c_char_p, c_char_p, c_int, vp, vp, vp, vp, vp)
        self.ncclGetUniqueId = _sig(nccl, "ncclGetUniqueId", c_int, POINTER(NcclUniqueId))
        self.ncclCommInitRank = _sig(nccl, "ncclCommInitRank", c_int, POINTER(vp), c_int,
                                     NcclUniqueId, c_int)
        self.ncclCommDestroy = _sig(nccl, "ncclCommDestroy", c_int, vp)
        self.ncclAllReduce = _sig(nccl, "ncclAllReduce", c_int, vp, vp, c_size_t, c_int, c_int,
                                  vp, vp)
        self.ncclAllGather = _sig(nccl, "ncclAllGather", c_int, vp, vp, c_size_t, c_int, vp, vp)
        self.ncclReduceScatter = _sig(nccl, "ncclReduceScatter", c_int, vp, vp, c_size_t, c_int,
                                      c_int, vp, vp)
        self.ncclBroadcast = _sig(nccl, "ncclBroadcast", c_int, vp, vp, c_size_t, c_int, c_int,
                                  vp, vp)
        self.ncclSend = _sig(nccl, "ncclSend", c_int, vp, c_size_t, c_int, c_int, vp, vp)
        self.ncclRecv = _sig(nccl, "ncclRecv", c_int, vp, c_size_t, c_int, c_int, vp, vp)
        req_t = CFUNCTYPE(None, POINTER(POINTER(c_uint8)), POINTER(c_size_t), POINTER(c_size_t))
        done_t = CFUNCTYPE(None, vp, c_uint32, POINTER(c_uint8), c_size_t, c_size_t)
        self.cuptiActivityRegisterCallbacks = _sig(cupti, "cuptiActivityRegisterCallbacks",
                                                   c_int, req_t, done_t)
        self.cuptiActivityEnable = _sig(cupti, "cuptiActivityEnable", c_int, c_int)
        self.cuptiActivityFlushAll = _sig(cupti, "cuptiActivityFlushAll", c_int, c_uint32)
        get_next = _sig(cupti, "cuptiActivityGetNextRecord", c_int, POINTER(c_uint8), c_size_t,
                        POINTER(vp))
        self.activity = _ActivityCounter(get_next, _cupti_record)
        self._req = req_t(self.activity.request)
        self._done = done_t(lambda ctx, sid, buf, size, valid: self.activity.complete(buf, valid))
        self._kernel_stubs: dict[str, ctypes.Array] = {}
        self._module = self._library = self._graph_exec = None

    def open_driver(self) -> None:
        """Binds the CUDA driver calls that libraries make without the
        runtime (cuBLAS, Triton, CUDA graphs, PyTorch's expandable
        segments), as device_nvidia.c links them."""
        cu = _load(self.lib_dir, "libcuda.so.1")
        vp, u = c_void_p, c_uint
        self.cuCtxGetDevice = _sig(cu, "cuCtxGetDevice", c_int, POINTER(c_int))
        self.cuModuleLoadData = _sig(cu, "cuModuleLoadData", c_int, POINTER(vp), c_char_p)
        self.cuModuleGetFunction = _sig(cu, "cuModuleGetFunction", c_int, POINTER(vp), vp,
                                        c_char_p)
        self.cuLibraryLoadData = _sig(cu, "cuLibraryLoadData", c_int, POINTER(vp), c_char_p, vp,
                                      vp, u, vp, vp, u)
        self.cuLibraryGetKernel = _sig(cu, "cuLibraryGetKernel", c_int, POINTER(vp), vp,
                                       c_char_p)
        self.cuKernelGetFunction = _sig(cu, "cuKernelGetFunction", c_int, POINTER(vp), vp)
        self.cuLaunchKernel = _sig(cu, "cuLaunchKernel", c_int, vp, u, u, u, u, u, u, u, vp,
                                   POINTER(vp), POINTER(vp))
        self.cuLaunchKernelEx = _sig(cu, "cuLaunchKernelEx", c_int, POINTER(CuLaunchConfig), vp,
                                     POINTER(vp), POINTER(vp))
        self.cuGraphCreate = _sig(cu, "cuGraphCreate", c_int, POINTER(vp), u)
        self.cuGraphAddKernelNode = _sig(cu, "cuGraphAddKernelNode_v2", c_int, POINTER(vp), vp,
                                         POINTER(vp), c_size_t, POINTER(CuKernelNodeParams))
        self.cuGraphInstantiateWithFlags = _sig(cu, "cuGraphInstantiateWithFlags", c_int,
                                                POINTER(vp), vp, c_uint64)
        self.cuGraphLaunch = _sig(cu, "cuGraphLaunch", c_int, vp, vp)
        self.cuMemGetAllocationGranularity = _sig(cu, "cuMemGetAllocationGranularity", c_int,
                                                  POINTER(c_size_t),
                                                  POINTER(CuMemAllocationProp), c_int)
        self.cuMemAddressReserve = _sig(cu, "cuMemAddressReserve", c_int, POINTER(c_uint64),
                                        c_size_t, c_size_t, c_uint64, c_uint64)
        self.cuMemCreate = _sig(cu, "cuMemCreate", c_int, POINTER(c_uint64), c_size_t,
                                POINTER(CuMemAllocationProp), c_uint64)
        self.cuMemRelease = _sig(cu, "cuMemRelease", c_int, c_uint64)
        self.cuMemMap = _sig(cu, "cuMemMap", c_int, c_uint64, c_size_t, c_size_t, c_uint64,
                             c_uint64)
        self.cuMemUnmap = _sig(cu, "cuMemUnmap", c_int, c_uint64, c_size_t)
        self.cuMemSetAccess = _sig(cu, "cuMemSetAccess", c_int, c_uint64, c_size_t,
                                   POINTER(CuMemAccessDesc), c_size_t)

    def init(self, local_rank: int) -> int:
        count = c_int(0)
        err = self.cudaGetDeviceCount(byref(count))
        return err or self.cudaSetDevice(local_rank % count.value if count.value else 0)

    def stream_create(self):
        s = c_void_p()
        return self.cudaStreamCreateWithFlags(byref(s), 1), s

    def stream_sync(self, s) -> int:
        return self.cudaStreamSynchronize(s)

    def malloc(self, nbytes: int):
        p = c_void_p()
        return self.cudaMalloc(byref(p), nbytes), p

    def memcpy_h2d(self, dst, src, nbytes: int, stream) -> int:
        return self.cudaMemcpyAsync(dst, src, nbytes, 1, stream)

    def register_kernel(self, name: str, with_runtime: bool):
        # A host stub address per kernel, named as nvcc's registration code does.
        stub = self._kernel_stubs.setdefault(name, ctypes.create_string_buffer(16))
        addr = ctypes.addressof(stub)
        if with_runtime:
            handle = self.registerFatBinary(None)
            n = name.encode()
            self.registerFunction(handle, addr, n, n, -1, None, None, None, None, None)
            self.registerFatBinaryEnd(handle)
        return 0, c_void_p(addr)

    def launch(self, handle, duration_ns: int, stream) -> int:
        spec = KernelSpec(KERNEL_MAGIC, KERNEL_SLEEP, duration_ns)
        args = (c_void_p * 1)(ctypes.addressof(spec))
        return self.cudaLaunchKernel(handle, Dim3(108, 1, 1), Dim3(256, 1, 1), args, 0, stream)

    def comm_id_create(self):
        uid = NcclUniqueId()
        return self.ncclGetUniqueId(byref(uid)), bytes(uid)

    def comm_init(self, nranks: int, blob: bytes, rank: int):
        comm = c_void_p()
        uid = NcclUniqueId.from_buffer_copy(blob)
        return self.ncclCommInitRank(byref(comm), nranks, uid, rank), comm

    def comm_destroy(self, comm) -> int:
        return self.ncclCommDestroy(comm)

    def allreduce(self, buf, count, comm, stream) -> int:
        return self.ncclAllReduce(buf, buf, count, self.FLOAT32, self.SUM, comm, stream)

    def allgather(self, send, recv, count, comm, stream) -> int:
        return self.ncclAllGather(send, recv, count, self.FLOAT32, comm, stream)

    def reducescatter(self, send, recv, count, comm, stream) -> int:
        return self.ncclReduceScatter(send, recv, count, self.FLOAT32, self.SUM, comm, stream)

    def broadcast(self, buf, count, root, comm, stream) -> int:
        return self.ncclBroadcast(buf, buf, count, self.FLOAT32, root, comm, stream)

    def send(self, buf, count, peer, comm, stream) -> int:
        return self.ncclSend(buf, count, self.FLOAT32, peer, comm, stream)

    def recv(self, buf, count, peer, comm, stream) -> int:
        return self.ncclRecv(buf, count, self.FLOAT32, peer, comm, stream)

    def activity_start(self, api_records: bool) -> int:
        err = self.cuptiActivityRegisterCallbacks(self._req, self._done)
        # CONCURRENT_KERNEL, MEMCPY (+ RUNTIME)
        for kind in (10, 1) + ((5,) if api_records else ()):
            err = err or self.cuptiActivityEnable(kind)
        return err

    def activity_drain(self) -> int:
        self.cuptiActivityFlushAll(0)
        return self.activity.take()

    def range_start(self, message: str) -> int:
        return 0

    def range_end(self, range_id: int) -> None:
        pass

    # ---- the driver API, as cuBLAS, NCCL and Triton use it ----

    def _driver_handle(self, k: DriverKernel) -> int:
        """Gets kernel `k`'s function at its first launch, as Triton loads
        its kernels at their first call."""
        if k.handle:
            return 0
        f = c_void_p()
        if k.library:
            if not self._library:
                lib = c_void_p()
                err = self.cuLibraryLoadData(byref(lib), b"sim", None, None, 0, None, None, 0)
                if err:
                    return err
                self._library = lib
            kernel = c_void_p()
            err = (self.cuLibraryGetKernel(byref(kernel), self._library, k.name.encode())
                   or self.cuKernelGetFunction(byref(f), kernel))
        else:
            if not self._module:
                mod = c_void_p()
                err = self.cuModuleLoadData(byref(mod), b"sim")
                if err:
                    return err
                self._module = mod
            err = self.cuModuleGetFunction(byref(f), self._module, k.name.encode())
        if err == 0:
            k.handle = f.value
        return err

    def driver_launch(self, k: DriverKernel, duration_ns: int, stream) -> int:
        err = self._driver_handle(k)
        if err:
            return err
        spec, params = _spec_params(duration_ns)
        if k.ex:
            config = CuLaunchConfig(64, 1, 1, 128, 1, 1, 4096, stream.value)
            return self.cuLaunchKernelEx(byref(config), k.handle, params, None)
        return self.cuLaunchKernel(k.handle, 32, 4, 1, 256, 1, 1, 0, stream, params, None)

    def graph_launch(self, nodes: list[DriverKernel], duration_ns: int, stream) -> int:
        """Launches the graph of `nodes` (built at the first launch, each
        node `duration_ns` long) whole, with cuGraphLaunch."""
        if not self._graph_exec:
            graph = c_void_p()
            err = self.cuGraphCreate(byref(graph), 0)
            if err:
                return err
            prev = None
            for k in nodes:
                err = self._driver_handle(k)
                if err:
                    return err
                spec, params = _spec_params(duration_ns)
                p = CuKernelNodeParams(func=k.handle, gridDimX=16, gridDimY=1, gridDimZ=1,
                                       blockDimX=128, blockDimY=1, blockDimZ=1,
                                       kernelParams=ctypes.cast(params, POINTER(c_void_p)))
                node = c_void_p()
                err = self.cuGraphAddKernelNode(byref(node), graph,
                                                byref(prev) if prev else None,
                                                1 if prev else 0, byref(p))
                if err:
                    return err
                prev = node
            exec_ = c_void_p()
            err = self.cuGraphInstantiateWithFlags(byref(exec_), graph, 0)
            if err:
                return err
            self._graph_exec = exec_
        return self.cuGraphLaunch(self._graph_exec, stream)

    # ---- expandable segments ----

    def _segment_prop(self) -> CuMemAllocationProp:
        dev = c_int(0)
        self.cuCtxGetDevice(byref(dev))
        prop = CuMemAllocationProp()
        prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = CuMemLocation(1, dev.value)  # CU_MEM_LOCATION_TYPE_DEVICE
        return prop

    def segment_page_size(self):
        n = c_size_t(0)
        prop = self._segment_prop()
        # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        return self.cuMemGetAllocationGranularity(byref(n), byref(prop), 1), n.value

    def segment_reserve(self, nbytes: int):
        base = c_uint64(0)
        return self.cuMemAddressReserve(byref(base), nbytes, 0, 0, 0), base.value

    def segment_map(self, addr: int, nbytes: int):
        """Creates a page and maps it at `addr`: (status, its handle)."""
        prop = self._segment_prop()
        h = c_uint64(0)
        err = self.cuMemCreate(byref(h), nbytes, byref(prop), 0)
        if err:
            return err, 0
        err = self.cuMemMap(addr, nbytes, 0, h, 0)
        if err:
            self.cuMemRelease(h)
            return err, 0
        access = CuMemAccessDesc(prop.location, 3)  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        err = self.cuMemSetAccess(addr, nbytes, byref(access), 1)
        return err, (0 if err else h.value)

    def segment_unmap(self, addr: int, nbytes: int, handles: list[int]) -> int:
        """Unmaps the range in one call, then releases each of its pages."""
        err = self.cuMemUnmap(addr, nbytes)
        for h in handles:
            err = err or self.cuMemRelease(h)
        return err


class AscendDevice:
    flavor = "ascend"
    OOM = 207001  # ACL_ERROR_RT_MEMORY_ALLOCATION
    ID_TYPE = HcclRootInfo
    FP32, SUM = 4, 0

    def __init__(self, lib_dir: str | None):
        self.lib_dir = lib_dir
        acl = _load(lib_dir, "libascendcl.so")
        hccl = _load(lib_dir, "libhccl.so")
        mspti = _load(lib_dir, "libmspti.so")
        vp = c_void_p
        self.aclInit = _sig(acl, "aclInit", c_int, c_char_p)
        self.aclrtGetDeviceCount = _sig(acl, "aclrtGetDeviceCount", c_int, POINTER(c_uint32))
        self.aclrtSetDevice = _sig(acl, "aclrtSetDevice", c_int, c_int)
        self.aclrtCreateStream = _sig(acl, "aclrtCreateStream", c_int, POINTER(vp))
        self.aclrtSynchronizeStream = _sig(acl, "aclrtSynchronizeStream", c_int, vp)
        self.aclrtMalloc = _sig(acl, "aclrtMalloc", c_int, POINTER(vp), c_size_t, c_int)
        self.aclrtMemcpyAsync = _sig(acl, "aclrtMemcpyAsync", c_int, vp, c_size_t, vp, c_size_t,
                                     c_int, vp)
        self.aclrtBinaryGetFunction = _sig(acl, "aclrtBinaryGetFunction", c_int, vp, c_char_p,
                                           POINTER(vp))
        self.aclrtLaunchKernel = _sig(acl, "aclrtLaunchKernel", c_int, vp, c_uint32, vp,
                                      c_size_t, vp)
        self.HcclGetRootInfo = _sig(hccl, "HcclGetRootInfo", c_int, POINTER(HcclRootInfo))
        self.HcclCommInitRootInfo = _sig(hccl, "HcclCommInitRootInfo", c_int, c_uint32,
                                         POINTER(HcclRootInfo), c_uint32, POINTER(vp))
        self.HcclCommDestroy = _sig(hccl, "HcclCommDestroy", c_int, vp)
        self.HcclAllReduce = _sig(hccl, "HcclAllReduce", c_int, vp, vp, c_uint64, c_int, c_int,
                                  vp, vp)
        self.HcclAllGather = _sig(hccl, "HcclAllGather", c_int, vp, vp, c_uint64, c_int, vp, vp)
        self.HcclReduceScatter = _sig(hccl, "HcclReduceScatter", c_int, vp, vp, c_uint64, c_int,
                                      c_int, vp, vp)
        self.HcclBroadcast = _sig(hccl, "HcclBroadcast", c_int, vp, c_uint64, c_int, c_uint32,
                                  vp, vp)
        self.HcclSend = _sig(hccl, "HcclSend", c_int, vp, c_uint64, c_int, c_uint32, vp, vp)
        self.HcclRecv = _sig(hccl, "HcclRecv", c_int, vp, c_uint64, c_int, c_uint32, vp, vp)
        req_t = CFUNCTYPE(None, POINTER(POINTER(c_uint8)), POINTER(c_size_t), POINTER(c_size_t))
        done_t = CFUNCTYPE(None, POINTER(c_uint8), c_size_t, c_size_t)
        self.msptiActivityRegisterCallbacks = _sig(mspti, "msptiActivityRegisterCallbacks",
                                                   c_int, req_t, done_t)
        self.msptiActivityEnable = _sig(mspti, "msptiActivityEnable", c_int, c_int)
        self.msptiActivityFlushAll = _sig(mspti, "msptiActivityFlushAll", c_int, c_uint32)
        get_next = _sig(mspti, "msptiActivityGetNextRecord", c_int, POINTER(c_uint8), c_size_t,
                        POINTER(vp))
        self.mstxRangeStartA = _sig(mspti, "mstxRangeStartA", c_uint64, c_char_p, vp)
        self.mstxRangeEnd = _sig(mspti, "mstxRangeEnd", None, c_uint64)
        self.activity = _ActivityCounter(get_next, _mspti_record)
        self._req = req_t(self.activity.request)
        self._done = done_t(lambda buf, size, valid: self.activity.complete(buf, valid))

    def open_driver(self) -> None:
        """Binds the CANN runtime calls that operator libraries make
        without AscendCL, as device_ascend.c links them."""
        rt = _load(self.lib_dir, "libruntime.so")
        vp = c_void_p
        self.rtFunctionRegister = _sig(rt, "rtFunctionRegister", c_int, vp, vp, c_char_p, vp,
                                       c_uint32)
        self.rtGetFunctionByName = _sig(rt, "rtGetFunctionByName", c_int, c_char_p, POINTER(vp))
        self.rtKernelLaunch = _sig(rt, "rtKernelLaunch", c_int, vp, c_uint32, vp, c_uint32, vp,
                                   vp)
        self.rtKernelLaunchWithFlag = _sig(rt, "rtKernelLaunchWithFlag", c_int, vp, c_uint32,
                                           POINTER(RtArgsEx), vp, vp, c_uint32)
        # The binary handle the stubs register under, and the stubs: host
        # addresses of the operator library's own, one per kernel.
        self._operator_binary = ctypes.create_string_buffer(8)
        self._operator_stubs: dict[str, ctypes.Array] = {}

    def init(self, local_rank: int) -> int:
        err = self.aclInit(None)
        count = c_uint32(0)
        err = err or self.aclrtGetDeviceCount(byref(count))
        return err or self.aclrtSetDevice(local_rank % count.value if count.value else 0)

    def stream_create(self):
        s = c_void_p()
        return self.aclrtCreateStream(byref(s)), s

    def stream_sync(self, s) -> int:
        return self.aclrtSynchronizeStream(s)

    def malloc(self, nbytes: int):
        p = c_void_p()
        return self.aclrtMalloc(byref(p), nbytes, 0), p

    def memcpy_h2d(self, dst, src, nbytes: int, stream) -> int:
        return self.aclrtMemcpyAsync(dst, nbytes, src, nbytes, 1, stream)

    def register_kernel(self, name: str, with_runtime: bool):
        handle = c_void_p()
        err = self.aclrtBinaryGetFunction(None, name.encode(), byref(handle)) if with_runtime else 0
        return err, handle

    def launch(self, handle, duration_ns: int, stream) -> int:
        spec = KernelSpec(KERNEL_MAGIC, KERNEL_SLEEP, duration_ns)
        return self.aclrtLaunchKernel(handle, 48, ctypes.addressof(spec), ctypes.sizeof(spec),
                                      stream)

    def comm_id_create(self):
        info = HcclRootInfo()
        return self.HcclGetRootInfo(byref(info)), bytes(info)

    def comm_init(self, nranks: int, blob: bytes, rank: int):
        comm = c_void_p()
        info = HcclRootInfo.from_buffer_copy(blob)
        return self.HcclCommInitRootInfo(nranks, byref(info), rank, byref(comm)), comm

    def comm_destroy(self, comm) -> int:
        return self.HcclCommDestroy(comm)

    def allreduce(self, buf, count, comm, stream) -> int:
        return self.HcclAllReduce(buf, buf, count, self.FP32, self.SUM, comm, stream)

    def allgather(self, send, recv, count, comm, stream) -> int:
        return self.HcclAllGather(send, recv, count, self.FP32, comm, stream)

    def reducescatter(self, send, recv, count, comm, stream) -> int:
        return self.HcclReduceScatter(send, recv, count, self.FP32, self.SUM, comm, stream)

    def broadcast(self, buf, count, root, comm, stream) -> int:
        return self.HcclBroadcast(buf, count, self.FP32, root, comm, stream)

    def send(self, buf, count, peer, comm, stream) -> int:
        return self.HcclSend(buf, count, self.FP32, peer, comm, stream)

    def recv(self, buf, count, peer, comm, stream) -> int:
        return self.HcclRecv(buf, count, self.FP32, peer, comm, stream)

    def activity_start(self, api_records: bool) -> int:
        err = self.msptiActivityRegisterCallbacks(self._req, self._done)
        # KERNEL, HCCL, COMMUNICATION (+ API)
        for kind in (2, 4, 9) + ((3,) if api_records else ()):
            err = err or self.msptiActivityEnable(kind)
        return err

    def activity_drain(self) -> int:
        self.msptiActivityFlushAll(1)
        return self.activity.take()

    def range_start(self, message: str) -> int:
        return self.mstxRangeStartA(message.encode(), None)

    def range_end(self, range_id: int) -> None:
        self.mstxRangeEnd(range_id)

    def driver_launch(self, k: DriverKernel, duration_ns: int, stream) -> int:
        """An operator kernel launched through the CANN runtime: at its first
        launch the library registers its stub (rtFunctionRegister) and, with
        `library` set, finds it again by name (rtGetFunctionByName)."""
        if not k.handle:
            stub = self._operator_stubs.setdefault(k.name, ctypes.create_string_buffer(16))
            err = self.rtFunctionRegister(ctypes.addressof(self._operator_binary),
                                          ctypes.addressof(stub), k.name.encode(), None, 0)
            if err:
                return err
            found = c_void_p(ctypes.addressof(stub))
            if k.library:
                err = self.rtGetFunctionByName(k.name.encode(), byref(found))
                if err:
                    return err
            k.handle = found.value
        spec = KernelSpec(KERNEL_MAGIC, KERNEL_SLEEP, duration_ns)
        if k.ex:
            args = RtArgsEx(args=ctypes.addressof(spec), argsSize=ctypes.sizeof(spec))
            return self.rtKernelLaunchWithFlag(k.handle, 24, byref(args), None, stream, 0)
        return self.rtKernelLaunch(k.handle, 24, ctypes.addressof(spec), ctypes.sizeof(spec),
                                   None, stream)


def open_device(flavor: str, lib_dir: str | None):
    return (NvidiaDevice if flavor == "nvidia" else AscendDevice)(lib_dir)
