//! The device libraries' enums, by their real values: data types, reduction
//! ops, copy directions. Values come from a register whose upper 32 bits
//! the ABI leaves undefined for an `int`/enum argument, so callers pass the
//! low 32 bits only.

use std::fmt;

/// An element type of a collective (`ncclDataType_t`, `HcclDataType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    Int8,
    Uint8,
    Int16,
    Uint16,
    Int32,
    Uint32,
    Int64,
    Uint64,
    Fp16,
    Bf16,
    Fp32,
    Fp64,
    Fp8E4M3,
    Fp8E5M2,
    Int128,
    /// A value this catalog does not know.
    Unknown(u32),
}

impl DataType {
    /// `ncclDataType_t`: int8 0, uint8 1, int32 2, uint32 3, int64 4,
    /// uint64 5, float16 6, float32 7, float64 8, bfloat16 9, and since NCCL
    /// 2.24 float8e4m3 10, float8e5m2 11.
    pub fn from_nccl(v: u32) -> DataType {
        use DataType::*;
        match v {
            0 => Int8,
            1 => Uint8,
            2 => Int32,
            3 => Uint32,
            4 => Int64,
            5 => Uint64,
            6 => Fp16,
            7 => Fp32,
            8 => Fp64,
            9 => Bf16,
            10 => Fp8E4M3,
            11 => Fp8E5M2,
            v => Unknown(v),
        }
    }

    /// `HcclDataType` (and `msptiCommunicationDataType`): INT8 0, INT16 1,
    /// INT32 2, FP16 3, FP32 4, INT64 5, UINT64 6, UINT8 7, UINT16 8,
    /// UINT32 9, FP64 10, BFP16 11, INT128 12.
    pub fn from_hccl(v: u32) -> DataType {
        use DataType::*;
        match v {
            0 => Int8,
            1 => Int16,
            2 => Int32,
            3 => Fp16,
            4 => Fp32,
            5 => Int64,
            6 => Uint64,
            7 => Uint8,
            8 => Uint16,
            9 => Uint32,
            10 => Fp64,
            11 => Bf16,
            12 => Int128,
            v => Unknown(v),
        }
    }

    /// Bytes per element.
    pub fn size(self) -> Option<u64> {
        use DataType::*;
        Some(match self {
            Int8 | Uint8 | Fp8E4M3 | Fp8E5M2 => 1,
            Int16 | Uint16 | Fp16 | Bf16 => 2,
            Int32 | Uint32 | Fp32 => 4,
            Int64 | Uint64 | Fp64 => 8,
            Int128 => 16,
            Unknown(_) => return None,
        })
    }

    /// Short name: "bf16", "fp32", "int8", ...
    pub fn name(self) -> &'static str {
        use DataType::*;
        match self {
            Int8 => "int8",
            Uint8 => "uint8",
            Int16 => "int16",
            Uint16 => "uint16",
            Int32 => "int32",
            Uint32 => "uint32",
            Int64 => "int64",
            Uint64 => "uint64",
            Fp16 => "fp16",
            Bf16 => "bf16",
            Fp32 => "fp32",
            Fp64 => "fp64",
            Fp8E4M3 => "fp8e4m3",
            Fp8E5M2 => "fp8e5m2",
            Int128 => "int128",
            Unknown(_) => "unknown",
        }
    }

    /// The type its [`fmt::Display`] text names (`bf16`, `dtype(42)`): how
    /// a trace's `dtype` argument reads back.
    pub fn from_name(s: &str) -> Option<DataType> {
        use DataType::*;
        if let Some(v) = s.strip_prefix("dtype(").and_then(|r| r.strip_suffix(')')) {
            return v.parse().ok().map(Unknown);
        }
        [
            Int8, Uint8, Int16, Uint16, Int32, Uint32, Int64, Uint64, Fp16, Bf16, Fp32, Fp64,
            Fp8E4M3, Fp8E5M2, Int128,
        ]
        .into_iter()
        .find(|t| t.name() == s)
    }

    /// `count` elements in bytes, if the type is known and nothing overflows.
    pub fn bytes(self, count: u64) -> Option<u64> {
        count.checked_mul(self.size()?)
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataType::Unknown(v) => write!(f, "dtype({v})"),
            t => f.write_str(t.name()),
        }
    }
}

/// A reduction (`ncclRedOp_t`, `HcclReduceOp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RedOp {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
    /// An NCCL user-defined op (`ncclRedOpCreatePreMulSum`: values from
    /// `ncclNumOps` = 5 up).
    Custom(u32),
    Unknown(u32),
}

impl RedOp {
    /// ncclSum 0, ncclProd 1, ncclMax 2, ncclMin 3, ncclAvg 4; 5 and up are
    /// user-defined ops (NCCL hands out values below 2^31).
    pub fn from_nccl(v: u32) -> RedOp {
        match v {
            0 => RedOp::Sum,
            1 => RedOp::Prod,
            2 => RedOp::Max,
            3 => RedOp::Min,
            4 => RedOp::Avg,
            v if v < 1 << 31 => RedOp::Custom(v),
            v => RedOp::Unknown(v),
        }
    }

    /// HCCL_REDUCE_SUM 0, PROD 1, MAX 2, MIN 3.
    pub fn from_hccl(v: u32) -> RedOp {
        match v {
            0 => RedOp::Sum,
            1 => RedOp::Prod,
            2 => RedOp::Max,
            3 => RedOp::Min,
            v => RedOp::Unknown(v),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RedOp::Sum => "sum",
            RedOp::Prod => "prod",
            RedOp::Max => "max",
            RedOp::Min => "min",
            RedOp::Avg => "avg",
            RedOp::Custom(_) => "premulsum",
            RedOp::Unknown(_) => "unknown",
        }
    }
}

impl RedOp {
    /// The op its [`fmt::Display`] text names (`sum`, `op(9)`); a
    /// user-defined op's text (`premulsum`) does not say its value: `value`
    /// does, where the writer kept it.
    pub fn from_name(s: &str, value: Option<u32>) -> Option<RedOp> {
        if let Some(v) = s.strip_prefix("op(").and_then(|r| r.strip_suffix(')')) {
            return v.parse().ok().map(RedOp::Unknown);
        }
        Some(match s {
            "sum" => RedOp::Sum,
            "prod" => RedOp::Prod,
            "max" => RedOp::Max,
            "min" => RedOp::Min,
            "avg" => RedOp::Avg,
            "premulsum" => RedOp::Custom(value?),
            _ => return None,
        })
    }

    /// A user-defined op's value (the one thing its name leaves out).
    pub fn custom_value(self) -> Option<u32> {
        match self {
            RedOp::Custom(v) => Some(v),
            _ => None,
        }
    }
}

impl fmt::Display for RedOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RedOp::Unknown(v) => write!(f, "op({v})"),
            op => f.write_str(op.name()),
        }
    }
}

/// A copy direction (`cudaMemcpyKind`, `aclrtMemcpyKind`: the same values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemcpyKind {
    HostToHost,
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
    /// `cudaMemcpyDefault` (direction from the pointers) / `ACL_MEMCPY_DEFAULT`.
    Default,
    Unknown(u32),
}

impl MemcpyKind {
    /// HostToHost 0, HostToDevice 1, DeviceToHost 2, DeviceToDevice 3,
    /// Default 4 (CUDA and ACL alike).
    pub fn from_raw(v: u32) -> MemcpyKind {
        match v {
            0 => MemcpyKind::HostToHost,
            1 => MemcpyKind::HostToDevice,
            2 => MemcpyKind::DeviceToHost,
            3 => MemcpyKind::DeviceToDevice,
            4 => MemcpyKind::Default,
            v => MemcpyKind::Unknown(v),
        }
    }

    /// "HtoD", "DtoH", ...
    pub fn name(self) -> &'static str {
        match self {
            MemcpyKind::HostToHost => "HtoH",
            MemcpyKind::HostToDevice => "HtoD",
            MemcpyKind::DeviceToHost => "DtoH",
            MemcpyKind::DeviceToDevice => "DtoD",
            MemcpyKind::Default => "default",
            MemcpyKind::Unknown(_) => "unknown",
        }
    }
}

impl MemcpyKind {
    /// The kind its `Debug` text names (`HostToDevice`, `Unknown(7)`): how
    /// a trace's memcpy `kind` argument reads back.
    pub fn from_debug(s: &str) -> Option<MemcpyKind> {
        if let Some(v) = s.strip_prefix("Unknown(").and_then(|r| r.strip_suffix(')')) {
            return v.parse().ok().map(MemcpyKind::Unknown);
        }
        Some(match s {
            "HostToHost" => MemcpyKind::HostToHost,
            "HostToDevice" => MemcpyKind::HostToDevice,
            "DeviceToHost" => MemcpyKind::DeviceToHost,
            "DeviceToDevice" => MemcpyKind::DeviceToDevice,
            "Default" => MemcpyKind::Default,
            _ => return None,
        })
    }
}

/// Bytes for people: "512 B", "64 MiB", "1.5 GiB".
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >= 1u64 << (10 * (unit + 1)) {
        unit += 1;
    }
    let scale = 1u64 << (10 * unit);
    if bytes.is_multiple_of(scale) {
        format!("{} {}", bytes / scale, UNITS[unit])
    } else {
        format!("{:.1} {}", bytes as f64 / scale as f64, UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_and_hccl_types_by_real_value() {
        assert_eq!(DataType::from_nccl(9), DataType::Bf16);
        assert_eq!(DataType::from_nccl(7), DataType::Fp32);
        assert_eq!(DataType::from_nccl(6), DataType::Fp16);
        assert_eq!(DataType::from_nccl(1), DataType::Uint8);
        assert_eq!(DataType::from_nccl(12), DataType::Unknown(12));
        assert_eq!(DataType::from_hccl(11), DataType::Bf16);
        assert_eq!(DataType::from_hccl(4), DataType::Fp32);
        assert_eq!(DataType::from_hccl(3), DataType::Fp16);
        assert_eq!(DataType::from_hccl(7), DataType::Uint8);
        assert_eq!(DataType::Bf16.name(), "bf16");
        assert_eq!(DataType::Fp32.to_string(), "fp32");
        assert_eq!(DataType::Unknown(99).to_string(), "dtype(99)");
        assert_eq!(DataType::Bf16.bytes(1 << 25), Some(64 << 20));
        assert_eq!(DataType::Fp64.bytes(u64::MAX), None, "overflow");
        assert_eq!(DataType::Unknown(1).bytes(1), None);
        // Every known nccl/hccl value has a size.
        for v in 0..12 {
            assert!(DataType::from_nccl(v).size().is_some());
            assert!(DataType::from_hccl(v).size().is_some());
        }
    }

    #[test]
    fn ops_and_copy_kinds() {
        assert_eq!(RedOp::from_nccl(0).to_string(), "sum");
        assert_eq!(RedOp::from_nccl(4).to_string(), "avg");
        assert_eq!(RedOp::from_nccl(5), RedOp::Custom(5));
        assert_eq!(
            RedOp::from_nccl(u32::MAX).to_string(),
            format!("op({})", u32::MAX)
        );
        assert_eq!(RedOp::from_hccl(2).to_string(), "max");
        assert_eq!(RedOp::from_hccl(4), RedOp::Unknown(4));
        assert_eq!(MemcpyKind::from_raw(1).name(), "HtoD");
        assert_eq!(MemcpyKind::from_raw(2).name(), "DtoH");
        assert_eq!(MemcpyKind::from_raw(9), MemcpyKind::Unknown(9));
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1024), "1 KiB");
        assert_eq!(human_bytes(64 << 20), "64 MiB");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(human_bytes(1 << 30), "1 GiB");
        assert_eq!(human_bytes(u64::MAX), "16.0 EiB");
    }
}
