//! The trace's schema: every event, track and argument the agent writes
//! into a Perfetto trace, named once, with a typed way to write each
//! argument and to read it back. The Perfetto sink writes through it;
//! [`read`] turns a trace back into the records that made it, for
//! `agent diagnose` and `agent merge`.
//!
//! The names and keys are the format users' traces and the end-to-end
//! tests read: a key may be added, never renamed or retyped.
//!
//! - [`names`]: event names, name prefixes and track names;
//! - [`keys`]: argument keys, each typed by what its value is;
//! - [`call`]: a device call's arguments, written and read back;
//! - [`read`]: the one packet loop, and trace -> records.

pub mod call;
pub mod keys;
pub mod names;
pub mod read;

#[cfg(test)]
mod fuzz_tests;
#[cfg(test)]
mod round_trip_tests;

use std::marker::PhantomData;

use xpuscope_perfetto::rewrite::{ArgRef, EventView};
use xpuscope_perfetto::{Arg, ArgValue};

/// An argument's key, typed by what its value is: `Key<Uint>` writes and
/// reads a `u64`. Writing one costs what a literal did (the name is a
/// `&'static str`; the value is not formatted unless it is text).
pub struct Key<T> {
    pub name: &'static str,
    kind: PhantomData<T>,
}

impl<T> Clone for Key<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Key<T> {}

impl<T> Key<T> {
    pub const fn new(name: &'static str) -> Self {
        Key {
            name,
            kind: PhantomData,
        }
    }

    /// Whether the event carries this argument (of whatever type).
    pub fn present(self, event: &EventView<'_>) -> bool {
        event.arg(self.name).is_some()
    }
}

/// Unsigned integers.
pub enum Uint {}
/// Signed integers (read back from unsigned ones too, where they fit).
pub enum Int {}
/// Addresses and handles, shown in hex.
pub enum Ptr {}
/// Text.
pub enum Text {}
/// Booleans.
pub enum Flag {}
/// A 64-bit hash as 16 hex digits (text, so the UI shows it whole).
pub enum Hex {}

impl Key<Uint> {
    pub fn arg(self, v: u64) -> Arg {
        Arg::new(self.name, ArgValue::Uint(v))
    }
    pub fn read(self, event: &EventView<'_>) -> Option<u64> {
        event.arg(self.name)?.as_u64()
    }
}

impl Key<Int> {
    pub fn arg(self, v: i64) -> Arg {
        Arg::new(self.name, ArgValue::Int(v))
    }
    pub fn read(self, event: &EventView<'_>) -> Option<i64> {
        match event.arg(self.name)? {
            ArgRef::Int(v) => Some(v),
            v => v.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
}

impl Key<Ptr> {
    pub fn arg(self, v: u64) -> Arg {
        Arg::new(self.name, ArgValue::Pointer(v))
    }
    pub fn read(self, event: &EventView<'_>) -> Option<u64> {
        event.arg(self.name)?.as_u64()
    }
}

impl Key<Text> {
    pub fn arg(self, v: impl Into<String>) -> Arg {
        Arg::new(self.name, ArgValue::Str(v.into()))
    }
    pub fn read<'a>(self, event: &EventView<'a>) -> Option<&'a str> {
        match event.arg(self.name)? {
            ArgRef::Str(s) => Some(s),
            _ => None,
        }
    }
}

impl Key<Flag> {
    pub fn arg(self, v: bool) -> Arg {
        Arg::new(self.name, ArgValue::Bool(v))
    }
    pub fn read(self, event: &EventView<'_>) -> Option<bool> {
        match event.arg(self.name)? {
            ArgRef::Bool(b) => Some(b),
            _ => None,
        }
    }
}

impl Key<Hex> {
    pub fn arg(self, v: u64) -> Arg {
        Arg::new(self.name, ArgValue::Str(format!("{v:016x}")))
    }
    pub fn read(self, event: &EventView<'_>) -> Option<u64> {
        match event.arg(self.name)? {
            ArgRef::Str(h) => u64::from_str_radix(h, 16).ok(),
            _ => None,
        }
    }
}
