//! Integration tests: every trace written here is decoded with the official
//! schema (`perfetto_protos`, independent of the writer) and checked
//! against the importer's rules (`xpuscope_tests::trace_check`).

mod suite;
