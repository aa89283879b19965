//! The agent's own parsers, compiled into this crate from their source
//! files: the agent is a binary-only crate, and these modules depend on
//! nothing else of it. A move of either file breaks this build at once.

#[path = "../../../agent/src/btf.rs"]
#[allow(dead_code)]
pub mod btf;

#[path = "../../../agent/src/procfs.rs"]
#[allow(dead_code)]
pub mod procfs;

#[path = "../../../agent/src/model/identity.rs"]
#[allow(dead_code)]
pub mod identity;
