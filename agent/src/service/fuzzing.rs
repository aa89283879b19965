//! A seeded byte mutator for the agent's input fuzz tests (the config
//! file, control API requests, trace files): deterministic, bounded, run
//! by `cargo test` like the parser targets in `tests/fuzz` (which cannot
//! reach these modules: the agent is a binary crate). Longer runs: raise
//! `ROUNDS`.

/// xorshift64*: enough randomness for mutations, reproducible by seed.
pub struct Mutator(u64);

impl Mutator {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// `seed` with a few random edits: flips, inserts (of bytes that matter
    /// to text formats), deletes, truncations, duplicated slices.
    pub fn mutate(&mut self, seed: &[u8]) -> Vec<u8> {
        const INTERESTING: &[u8] = b"\0\r\n\t =[]{}\":,.\\/'#-+0123456789\xff\xc3";
        let mut v = seed.to_vec();
        for _ in 0..1 + self.below(4) {
            match self.below(6) {
                0 if !v.is_empty() => {
                    let i = self.below(v.len());
                    v[i] ^= 1 << self.below(8);
                }
                1 => {
                    let i = self.below(v.len() + 1);
                    let b = INTERESTING[self.below(INTERESTING.len())];
                    v.insert(i, b);
                }
                2 if !v.is_empty() => {
                    let i = self.below(v.len());
                    v.remove(i);
                }
                3 => v.truncate(self.below(v.len() + 1)),
                4 if !v.is_empty() => {
                    let a = self.below(v.len());
                    let b = (a + self.below(64)).min(v.len());
                    let piece = v[a..b].to_vec();
                    let at = self.below(v.len() + 1);
                    v.splice(at..at, piece);
                }
                _ => {
                    let i = self.below(v.len() + 1);
                    v.insert(i, self.next() as u8);
                }
            }
        }
        v
    }
}
