//! User-space probe support for xpuscope.
//!
//! Today: [`maps`], reading a process's memory mappings from
//! `/proc/PID/maps`, which both the stack symbolizer (to name the file and
//! file offset of each frame) and the library probes (to find libcudart,
//! libnccl, ... in a process) stand on.
//!
//! ```no_run
//! let maps = xpuscope_probes::maps::ProcessMaps::read(1).unwrap();
//! if let Some(m) = maps.find(0x7f00_0000_1000) {
//!     println!("{} at file offset {:#x}", m.path, m.file_offset_of(0x7f00_0000_1000));
//! }
//! ```

pub mod maps;
