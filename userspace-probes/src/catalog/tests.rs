//! Catalog tests: names, ABI layouts, levels, the kernel spec.
use super::*;
use std::collections::HashSet;
use xpuscope_common::uprobe::{
    DEREF_STACK, ENTRY_STACK_ARGS, ENTRY_STACK_WORDS, ENTRY_STRING, RETURN_ON_SUCCESS, RETURN_TWICE,
};

#[test]
fn library_from_path() {
    let cases = [
        (
            "/x/nvidia/cuda_runtime/lib/libcudart.so.12",
            Some(Library::Cudart),
        ),
        (
            "/usr/local/cuda/lib64/libcudart.so.12.9.79",
            Some(Library::Cudart),
        ),
        ("/x/libcudart.so", Some(Library::Cudart)),
        (
            "/x/torch.libs/libcudart-9335f6a2.so.12",
            Some(Library::Cudart),
        ),
        ("/x/libnccl.so.2 (deleted)", Some(Library::Nccl)),
        ("/x/libnccl-net.so", None),
        ("/x/libcupti.so.12", Some(Library::Cupti)),
        (
            "/usr/local/Ascend/lib64/libascendcl.so",
            Some(Library::AscendCl),
        ),
        ("/usr/local/Ascend/lib64/libhccl.so", Some(Library::Hccl)),
        ("/usr/local/Ascend/lib64/libhccl_alg.so", None),
        ("/x/libmspti.so", Some(Library::Mspti)),
        (
            "/usr/local/Ascend/ascend-toolkit/latest/runtime/lib64/libruntime.so",
            Some(Library::AscendRuntime),
        ),
        ("/usr/local/Ascend/lib64/libruntime_common.so", None),
        ("/usr/local/Ascend/lib64/libruntime_v200.so", None),
        (
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            Some(Library::Cuda),
        ),
        ("/usr/lib64/libcuda.so.550.54.15", Some(Library::Cuda)),
        ("/x/libcuda.so", Some(Library::Cuda)),
        ("/x/libcudadebugger.so.1", None),
        ("/x/libcuda.so.1.bak", None),
        ("/x/libcudart_static.a", None),
        ("/x/libcudart.so.12.bak", None),
        ("libcudart.so.12", Some(Library::Cudart)),
        ("[vdso]", None),
        ("", None),
    ];
    for (path, want) in cases {
        assert_eq!(Library::from_path(path), want, "{path}");
    }
}

#[test]
fn names_and_aliases_are_unique_per_library() {
    for lib in Library::ALL {
        let mut seen = HashSet::new();
        for f in lib.functions() {
            for n in std::iter::once(&f.name).chain(f.aliases) {
                assert!(seen.insert(*n), "{lib:?}: {n} twice");
            }
        }
        assert!(!lib.functions().is_empty());
    }
}

#[test]
fn nccl_functions_alias_their_strong_symbol() {
    for f in Library::Nccl.functions() {
        assert_eq!(f.aliases, [format!("p{}", f.name).as_str()], "{}", f.name);
    }
}

#[test]
fn layouts_are_well_formed() {
    for (lib, f) in all_functions() {
        let mut regs = HashSet::new();
        let mut slots = HashSet::new();
        for a in f.args {
            match a.loc {
                ArgLoc::Reg(i) => assert!(i < 6 && regs.insert(i), "{}", f.name),
                ArgLoc::Stack(s) => {
                    assert!(slots.insert(s), "{}", f.name);
                    // Stack args must be inside the copied words.
                    assert!(1 + (s as usize) < ENTRY_STACK_WORDS, "{}", f.name);
                    // System V: stack args only once all six registers are used
                    // (by integer args or a register-passed aggregate).
                    assert_eq!(regs.len(), 6, "{} has a stack arg with free regs", f.name);
                }
            }
        }
        // Register args are consecutive from rdi (no gaps): every
        // argument of these APIs is INTEGER class.
        let max = regs.iter().copied().max().map_or(0, |m| m + 1);
        assert_eq!(regs.len(), max as usize, "{}: gap in registers", f.name);
        for (len, what) in [
            (f.capture.entry.map(|e| e.len), "entry"),
            (f.capture.ret.map(|r| r.len), "return"),
        ] {
            if let Some(len) = len {
                assert!(len > 0 && len as usize <= DEREF_BYTES, "{} {what}", f.name);
            }
        }
        if let Some(r) = f.capture.ret {
            assert!(
                matches!(
                    f.args
                        .iter()
                        .find(|a| a.loc == ArgLoc::Reg(r.arg))
                        .map(|a| a.role),
                    Some(
                        Role::DevPtrOut
                            | Role::CommOut
                            | Role::IdOut
                            | Role::ValueOut
                            | Role::MemHandleOut
                            | Role::FuncOut
                            | Role::RecordOut
                            | Role::TimestampOut
                    )
                ),
                "{}: return deref of a non-out argument",
                f.name
            );
        }
        let _ = lib;
    }
}

#[test]
fn documented_abi_traps() {
    let cuda = Library::Cudart.function("cudaLaunchKernel").unwrap();
    assert_eq!(cuda.arg(Role::Func), Some(ArgLoc::Reg(0)));
    assert_eq!(cuda.arg(Role::GridXY), Some(ArgLoc::Reg(1)));
    assert_eq!(cuda.arg(Role::GridZ), Some(ArgLoc::Reg(2)));
    assert_eq!(cuda.arg(Role::BlockXY), Some(ArgLoc::Reg(3)));
    assert_eq!(cuda.arg(Role::BlockZ), Some(ArgLoc::Reg(4)));
    assert_eq!(cuda.arg(Role::KernelArgs), Some(ArgLoc::Reg(5)));
    assert_eq!(cuda.arg(Role::SharedMem), Some(ArgLoc::Stack(0)));
    assert_eq!(cuda.arg(Role::Stream), Some(ArgLoc::Stack(1)));
    for (lib, name) in [
        (Library::Nccl, "ncclAllReduce"),
        (Library::Hccl, "HcclAllReduce"),
    ] {
        let f = lib.function(name).unwrap();
        assert_eq!(f.arg(Role::Comm), Some(ArgLoc::Reg(5)));
        assert_eq!(f.arg(Role::Stream), Some(ArgLoc::Stack(0)));
    }
    let init = Library::Nccl.function("ncclCommInitRank").unwrap();
    assert_eq!(init.arg(Role::NRanks), Some(ArgLoc::Reg(1)));
    assert_eq!(init.arg(Role::Rank), Some(ArgLoc::Reg(2)));
    assert_eq!(
        init.capture.entry,
        Some(EntryDeref {
            source: DerefSource::Stack { slot: 0 },
            len: 128,
            string: false
        })
    );
    assert_eq!(
        init.capture.ret,
        Some(ReturnDeref {
            arg: 0,
            len: 8,
            twice: false
        })
    );
    let hccl = Library::Hccl.function("HcclCommInitRootInfo").unwrap();
    assert_eq!(
        hccl.capture.entry.map(|e| e.source),
        Some(DerefSource::Arg(1))
    );
    assert_eq!(hccl.capture.ret.map(|r| r.arg), Some(3));
    for lib in [Library::Cupti, Library::Mspti] {
        let next = lib
            .functions()
            .iter()
            .find(|f| f.kind == CallKind::ActivityNextRecord)
            .unwrap();
        assert_eq!(
            next.capture.ret,
            Some(ReturnDeref {
                arg: 2,
                len: 128,
                twice: true
            })
        );
        assert_eq!(next.level, Level::L2);
    }
    let malloc = Library::Cudart.function("cudaMalloc").unwrap();
    assert_eq!(
        malloc.capture.ret,
        Some(ReturnDeref {
            arg: 0,
            len: 8,
            twice: false
        })
    );
}

#[test]
fn variants_share_their_base_layout() {
    for f in Library::Cudart.functions() {
        for suffix in ["_ptsz", "_ptds"] {
            if let Some(base) = f.name.strip_suffix(suffix) {
                let b = Library::Cudart
                    .function(base)
                    .unwrap_or_else(|| panic!("{base}"));
                assert_eq!(
                    (b.args, b.kind, b.capture, b.level),
                    (f.args, f.kind, f.capture, f.level),
                    "{}",
                    f.name
                );
            }
        }
    }
    for v in [
        "cudaLaunchKernel_ptsz",
        "__cudaLaunchKernel",
        "__cudaLaunchKernel_ptsz",
        "cudaMemcpyAsync_ptsz",
        "cudaMemcpy_ptds",
        "cudaStreamSynchronize_ptsz",
    ] {
        assert!(Library::Cudart.function(v).is_some(), "{v}");
    }
}

#[test]
fn levels() {
    assert_eq!(Level::L0.bit(), 1);
    assert_eq!(Level::L2.bit(), 4);
    assert_eq!(Level::L1.mask_up_to(), 0b11);
    let level = |lib: Library, n: &str| lib.function(n).unwrap().level;
    assert_eq!(level(Library::Nccl, "ncclAllReduce"), Level::L0);
    assert_eq!(level(Library::Cudart, "cudaStreamSynchronize"), Level::L0);
    assert_eq!(level(Library::Cudart, "cudaMalloc"), Level::L0);
    assert_eq!(level(Library::Nccl, "ncclCommInitRank"), Level::L0);
    assert_eq!(level(Library::Cudart, "cudaLaunchKernel"), Level::L1);
    assert_eq!(level(Library::Cudart, "cudaMemcpyAsync"), Level::L1);
    assert_eq!(
        level(Library::Cupti, "cuptiActivityGetNextRecord"),
        Level::L2
    );
}

#[test]
fn reads_cover_args_and_rsp() {
    let sync = Library::Cudart.function("cudaStreamSynchronize").unwrap();
    assert_eq!(sync.reads(), RegSet::EMPTY.with(Reg::Rdi).with(Reg::Rsp));
    let launch = Library::Cudart.function("cudaLaunchKernel").unwrap();
    for r in [
        Reg::Rdi,
        Reg::Rsi,
        Reg::Rdx,
        Reg::Rcx,
        Reg::R8,
        Reg::R9,
        Reg::Rsp,
    ] {
        assert!(launch.reads().contains(r), "{r:?}");
    }
    assert!(!launch.reads().contains(Reg::Rax));
}

#[test]
fn probe_spec_carries_capture() {
    let spec = |lib: Library, n: &str| lib.function(n).unwrap().probe_spec();
    let s = spec(Library::Cudart, "cudaMalloc");
    assert_eq!(
        (
            s.entry_deref_arg,
            s.return_deref_arg,
            s.entry_deref_len,
            s.return_deref_len,
            s.flags,
            s.level_bit
        ),
        (DEREF_NONE, 0, 0, 8, RETURN_ON_SUCCESS, 1)
    );
    // Stream and shared memory are passed on the stack: the entry reads
    // stack words (and only functions like it do).
    let s = spec(Library::Cudart, "cudaLaunchKernel");
    assert_eq!(
        (s.entry_deref_arg, s.return_deref_arg, s.flags, s.level_bit),
        (DEREF_NONE, DEREF_NONE, ENTRY_STACK_ARGS, 2)
    );
    assert_eq!(spec(Library::Cudart, "cudaSetDevice").flags, 0);
    let s = spec(Library::Hccl, "HcclCommInitRootInfo");
    assert_eq!(
        (
            s.entry_deref_arg,
            s.return_deref_arg,
            s.entry_deref_len,
            s.return_deref_len
        ),
        (1, 3, 128, 8)
    );
    // The by-value id: 128 bytes from sp + 8.
    let s = spec(Library::Nccl, "ncclCommInitRank");
    assert_eq!(
        (
            s.entry_deref_arg,
            s.entry_stack_off,
            s.entry_deref_len,
            s.return_deref_arg,
            s.return_deref_len
        ),
        (DEREF_STACK, 8, 128, 0, 8)
    );
    assert_ne!(s.flags & ENTRY_STACK_ARGS, 0);
    // Two levels: the record itself.
    let s = spec(Library::Cupti, "cuptiActivityGetNextRecord");
    assert_eq!(
        (s.return_deref_arg, s.return_deref_len, s.flags, s.level_bit),
        (2, 128, RETURN_TWICE | RETURN_ON_SUCCESS, 4)
    );
    let s = spec(Library::Mspti, "msptiActivityGetNextRecord");
    assert_eq!(s.flags & RETURN_TWICE, RETURN_TWICE);
    // Strings.
    let f = all_functions().find(|(_, f)| matches!(f.capture.entry, Some(e) if e.string));
    let (lib, f) = f.unwrap();
    assert_eq!(spec(lib, f.name).flags & ENTRY_STRING, ENTRY_STRING);
}

#[test]
fn driver_launch_layouts_follow_cuda_h() {
    // cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
    // six registers, then one 8-byte stack slot per unsigned/pointer.
    for name in [
        "cuLaunchKernel",
        "cuLaunchKernel_ptsz",
        "cuLaunchCooperativeKernel",
        "cuLaunchCooperativeKernel_ptsz",
    ] {
        let l = Library::Cuda.function(name).unwrap();
        assert_eq!(l.kind, CallKind::Launch(LaunchKind::Kernel), "{name}");
        assert_eq!(l.level, Level::L1, "{name}");
        assert_eq!(l.arg(Role::Func), Some(ArgLoc::Reg(0)));
        assert_eq!(l.arg(Role::GridX), Some(ArgLoc::Reg(1)));
        assert_eq!(l.arg(Role::GridZ), Some(ArgLoc::Reg(3)));
        assert_eq!(l.arg(Role::BlockY), Some(ArgLoc::Reg(5)));
        assert_eq!(l.arg(Role::BlockZ), Some(ArgLoc::Stack(0)));
        assert_eq!(l.arg(Role::SharedMem), Some(ArgLoc::Stack(1)));
        assert_eq!(l.arg(Role::Stream), Some(ArgLoc::Stack(2)));
        assert_eq!(l.arg(Role::KernelArgs), Some(ArgLoc::Stack(3)));
        assert_ne!(l.probe_spec().flags & ENTRY_STACK_ARGS, 0);
    }
    let ex = Library::Cuda.function("cuLaunchKernelEx").unwrap();
    assert_eq!(ex.arg(Role::LaunchConfig), Some(ArgLoc::Reg(0)));
    assert_eq!(ex.arg(Role::Func), Some(ArgLoc::Reg(1)));
    assert_eq!(
        ex.capture.entry.map(|e| (e.source, e.len)),
        Some((DerefSource::Arg(0), 40))
    );
    let graph = Library::Cuda.function("cuGraphLaunch").unwrap();
    assert_eq!(
        (graph.kind, graph.level, graph.optional),
        (CallKind::Launch(LaunchKind::Graph), Level::L1, false)
    );
}

#[test]
fn driver_memory_syncs_and_handles_are_default_level() {
    for f in Library::Cuda.functions() {
        let want = match f.kind {
            CallKind::Launch(_) => Level::L1,
            _ => Level::L0,
        };
        assert_eq!(f.level, want, "{}", f.name);
    }
    let alloc = Library::Cuda.function("cuMemAlloc_v2").unwrap();
    assert_eq!(alloc.kind, CallKind::Malloc);
    assert_eq!(alloc.capture.ret.map(|r| (r.arg, r.len)), Some((0, 8)));
    let map = Library::Cuda.function("cuMemMap").unwrap();
    assert_eq!(map.kind, CallKind::Vmm(VmmOp::Map));
    assert_eq!(map.arg(Role::DevPtr), Some(ArgLoc::Reg(0)));
    assert_eq!(map.arg(Role::Size), Some(ArgLoc::Reg(1)));
    assert_eq!(map.arg(Role::MemHandle), Some(ArgLoc::Reg(3)));
    let unmap = Library::Cuda.function("cuMemUnmap").unwrap();
    assert_eq!(unmap.kind, CallKind::Vmm(VmmOp::Unmap));
    let create = Library::Cuda.function("cuMemCreate").unwrap();
    assert_eq!(create.capture.ret.map(|r| (r.arg, r.len)), Some((0, 8)));
    // The handle-giving calls copy the name at entry and the handle at
    // return, only when the call succeeded.
    for name in ["cuModuleGetFunction", "cuLibraryGetKernel"] {
        let g = Library::Cuda.function(name).unwrap();
        assert!(matches!(g.kind, CallKind::KernelHandle(_)), "{name}");
        assert_eq!(
            g.capture.entry,
            Some(EntryDeref {
                source: DerefSource::Arg(2),
                len: 128,
                string: true
            })
        );
        let s = g.probe_spec();
        assert_eq!(
            (s.entry_deref_arg, s.return_deref_arg, s.return_deref_len),
            (2, 0, 8)
        );
        assert_eq!(
            s.flags & (ENTRY_STRING | RETURN_ON_SUCCESS),
            ENTRY_STRING | RETURN_ON_SUCCESS
        );
    }
    let kf = Library::Cuda.function("cuKernelGetFunction").unwrap();
    assert_eq!(kf.arg(Role::Func), Some(ArgLoc::Reg(1)));
    assert_eq!(kf.capture.ret.map(|r| r.arg), Some(0));
    assert_eq!(Library::Cuda.soname(), "libcuda.so.1");
    assert_eq!(Library::Cuda.vendor(), Vendor::Nvidia);
}

#[test]
fn cann_runtime_layouts_follow_its_headers() {
    let rt = Library::AscendRuntime;
    assert_eq!(
        (rt.soname(), rt.vendor()),
        ("libruntime.so", Vendor::Ascend)
    );
    // Memory, syncs and names at the default level, launches at L1.
    for f in rt.functions() {
        let want = match f.kind {
            CallKind::Launch(_) => Level::L1,
            _ => Level::L0,
        };
        assert_eq!(f.level, want, "{}", f.name);
    }
    // rtKernelLaunch(stubFunc, numBlocks, args, argsSize, smDesc, stm).
    let l = rt.function("rtKernelLaunch").unwrap();
    assert_eq!(
        (l.kind, l.optional),
        (CallKind::Launch(LaunchKind::Kernel), false)
    );
    assert_eq!(l.arg(Role::Func), Some(ArgLoc::Reg(0)));
    assert_eq!(l.arg(Role::NumBlocks), Some(ArgLoc::Reg(1)));
    assert_eq!(l.arg(Role::ArgsSize), Some(ArgLoc::Reg(3)));
    assert_eq!(l.arg(Role::Stream), Some(ArgLoc::Reg(5)));
    assert_eq!(l.probe_spec().flags & ENTRY_STACK_ARGS, 0);
    // What aclrtLaunchKernel calls: (funcHandle, numBlocks, argsInfo, stm, cfg).
    let v3 = rt.function("rtLaunchKernelByFuncHandleV3").unwrap();
    assert_eq!(v3.arg(Role::Stream), Some(ArgLoc::Reg(3)));
    assert!(v3.optional);
    // (hdl, tilingKey, numBlocks, argsInfo, smDesc, stm, info): no kernel handle.
    let h = rt.function("rtKernelLaunchWithHandle").unwrap();
    assert_eq!(
        (
            h.arg(Role::Func),
            h.arg(Role::NumBlocks),
            h.arg(Role::Stream)
        ),
        (None, Some(ArgLoc::Reg(2)), Some(ArgLoc::Reg(5)))
    );
    let c = rt.function("rtsLaunchKernelWithConfig").unwrap();
    assert_eq!(c.arg(Role::Stream), Some(ArgLoc::Reg(2)));
    // rtMalloc(void **devPtr, uint64_t size, rtMemType_t type, uint16_t moduleId).
    let m = rt.function("rtMalloc").unwrap();
    assert_eq!(
        (
            m.kind,
            m.arg(Role::Size),
            m.capture.ret.map(|r| (r.arg, r.len))
        ),
        (CallKind::Malloc, Some(ArgLoc::Reg(1)), Some((0, 8)))
    );
    assert_eq!(rt.function("rtFree").unwrap().kind, CallKind::Free);
    for (name, sync) in [
        ("rtStreamSynchronize", SyncKind::Stream),
        ("rtEventSynchronize", SyncKind::Event),
        ("rtDeviceSynchronize", SyncKind::Device),
    ] {
        assert_eq!(rt.function(name).unwrap().kind, CallKind::Sync(sync));
    }
    // The names: rtFunctionRegister's stub is passed in (no return copy);
    // the lookups write the handle through their last argument.
    let reg = rt.function("rtFunctionRegister").unwrap();
    assert_eq!(
        (reg.arg(Role::Func), reg.capture.ret),
        (Some(ArgLoc::Reg(1)), None)
    );
    assert_eq!(
        reg.capture.entry,
        Some(EntryDeref {
            source: DerefSource::Arg(2),
            len: 128,
            string: true
        })
    );
    for (name, string, out) in [
        ("rtGetFunctionByName", 0, 1),
        ("rtsFuncGetByName", 1, 2),
        ("rtBinaryGetFunctionByName", 1, 2),
    ] {
        let g = rt.function(name).unwrap();
        assert!(matches!(g.kind, CallKind::KernelHandle(_)), "{name}");
        let s = g.probe_spec();
        assert_eq!(
            (s.entry_deref_arg, s.return_deref_arg, s.return_deref_len),
            (string, out, 8),
            "{name}"
        );
        assert_eq!(
            s.flags & (ENTRY_STRING | RETURN_ON_SUCCESS),
            ENTRY_STRING | RETURN_ON_SUCCESS
        );
    }
}
