//! Device activity records (CUPTI, MSPTI): true device start and end times.
//!
//! The application iterates a completed buffer with
//! `cuptiActivityGetNextRecord(buffer, validSize, CUpti_Activity **record)`
//! / `msptiActivityGetNextRecord(...)`; on return `*record` points at the
//! next record inside the buffer. The return probe reads that pointer and
//! then the record itself (a two-level copy, see
//! [`crate::catalog::ReturnDeref::twice`]), at most
//! [`xpuscope_common::uprobe::DEREF_BYTES`] (128) bytes: every field decoded
//! here lies in the first 112 bytes of the largest record (CUPTI's 208-byte
//! kernel record). The buffer is reused once the completion callback
//! returns, so the copy must happen in the probe, not later.
//!
//! Names (kernel, API, HCCL op, communicator, marker message) are pointers
//! into the application's memory: [`DeviceActivity::name_ptr`]. They stay
//! valid for the life of the process (CUPTI and MSPTI own them), so the
//! agent reads each one once and caches it: [`names::RemoteStrings`].
//!
//! Every record comes from the traced process: lengths are checked, kinds
//! not known here are errors, nothing panics.

pub mod cupti;
pub mod mspti;
pub mod names;

use crate::catalog::Library;
use crate::enums::{DataType, MemcpyKind};

/// Which activity API produced a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActivityApi {
    Cupti,
    Mspti,
}

impl ActivityApi {
    /// The API of a library's `*ActivityGetNextRecord`.
    pub fn of(library: Library) -> Option<ActivityApi> {
        match library {
            Library::Cupti => Some(ActivityApi::Cupti),
            Library::Mspti => Some(ActivityApi::Mspti),
            _ => None,
        }
    }
}

/// What a record describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActivityKind {
    /// A kernel on the device.
    Kernel,
    /// A copy on the device's copy engines.
    Memcpy,
    /// A host API call (CUPTI RUNTIME/DRIVER, MSPTI API).
    Api,
    /// An HCCL operation on the device (MSPTI HCCL).
    Hccl,
    /// A communication task (MSPTI COMMUNICATION).
    Communication,
    /// A marker or range (MSPTI MARKER).
    Marker,
}

/// Kind-specific fields.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ActivityDetail {
    None,
    /// CUPTI kernel launch shape.
    Launch {
        grid: [i32; 3],
        block: [i32; 3],
        static_shared: i32,
        dynamic_shared: i32,
    },
    /// MSPTI kernel: pointer to its type string.
    KernelType {
        type_ptr: u64,
    },
    Memcpy {
        bytes: u64,
        kind: MemcpyKind,
    },
    Api {
        /// CUPTI callback id (`cudaLaunchKernel_v7000` = 211, ...).
        cbid: Option<u32>,
        pid: u32,
        tid: u32,
        ret: Option<u32>,
    },
    Hccl {
        bandwidth_gbps: f64,
        comm_name_ptr: u64,
    },
    Communication {
        dtype: DataType,
        count: u64,
        alg_ptr: u64,
        comm_name_ptr: u64,
    },
    Marker {
        /// `msptiActivityFlag` bits (instantaneous 1, start 2, end 4, ...).
        flag: u32,
        /// 0 host, 1 device.
        source_kind: u32,
        id: u64,
        /// Host markers: the process and thread.
        pid_tid: Option<(u32, u32)>,
        domain_ptr: u64,
    },
}

/// One decoded activity record.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceActivity {
    pub api: ActivityApi,
    pub kind: ActivityKind,
    /// The record's raw kind value.
    pub raw_kind: u32,
    /// Start and end in the API's clock (the stand-ins: CLOCK_BOOTTIME ns;
    /// real CUPTI: its own timestamp, see `cuptiGetTimestamp`); a marker's
    /// single timestamp is both.
    pub start: u64,
    pub end: u64,
    pub device: Option<u32>,
    pub stream: Option<u64>,
    pub correlation_id: Option<u64>,
    /// Pointer to the NUL-terminated name in the application (0: none).
    pub name_ptr: Option<u64>,
    pub detail: ActivityDetail,
}

/// A record that cannot be decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ActivityError {
    #[error("{api:?} record of kind {kind} has {len} bytes, needs {need}")]
    Short {
        api: ActivityApi,
        kind: u32,
        len: usize,
        need: usize,
    },
    #[error("{api:?} record kind {kind} is not decoded")]
    UnknownKind { api: ActivityApi, kind: u32 },
    #[error("{api:?} record has no kind (only {len} bytes)")]
    Empty { api: ActivityApi, len: usize },
}

/// Decodes one record copied from the application.
pub fn parse(api: ActivityApi, record: &[u8]) -> Result<DeviceActivity, ActivityError> {
    match api {
        ActivityApi::Cupti => cupti::parse(record),
        ActivityApi::Mspti => mspti::parse(record),
    }
}

/// Fails with `Short` unless `record` has `need` bytes.
pub(crate) fn need(
    api: ActivityApi,
    kind: u32,
    record: &[u8],
    need: usize,
) -> Result<(), ActivityError> {
    if record.len() < need {
        return Err(ActivityError::Short {
            api,
            kind,
            len: record.len(),
            need,
        });
    }
    Ok(())
}

pub(crate) fn nonzero(p: u64) -> Option<u64> {
    (p != 0).then_some(p)
}
