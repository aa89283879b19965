"""ctypes bindings of the device libraries for the CPython flavor of a rank:
the same calls, with the same real C signatures, as src/device_*.c.

NvidiaDevice: libcudart.so.12, libnccl.so.2, libcupti.so.12.
AscendDevice: libascendcl.so, libhccl.so, libmspti.so.
Each method returns the library's status code (0 = success).
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from ctypes import (CFUNCTYPE, POINTER, Structure, byref, c_char, c_char_p, c_int, c_size_t,
                    c_uint, c_uint8, c_uint32, c_uint64, c_void_p)

KERNEL_MAGIC = 0x4E524B53  # standin_kernel.h: the bytes "SKRN"
KERNEL_SLEEP = 0
ACTIVITY_BUFFER_BYTES = 256 * 1024


class KernelSpec(Structure):
    """struct standin_kernel_spec (standin_kernel.h)."""

    _fields_ = [("magic", c_uint32), ("mode", c_uint32), ("duration_ns", c_uint64)]


class Dim3(Structure):
    _fields_ = [("x", c_uint), ("y", c_uint), ("z", c_uint)]


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


class AscendDevice:
    flavor = "ascend"
    OOM = 207001  # ACL_ERROR_RT_MEMORY_ALLOCATION
    ID_TYPE = HcclRootInfo
    FP32, SUM = 4, 0

    def __init__(self, lib_dir: str | None):
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


def open_device(flavor: str, lib_dir: str | None):
    return (NvidiaDevice if flavor == "nvidia" else AscendDevice)(lib_dir)
