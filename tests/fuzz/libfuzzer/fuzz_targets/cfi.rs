#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| xpuscope_fuzz::cfi(data));
