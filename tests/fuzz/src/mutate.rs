//! A small, seeded mutator for the stable replay: deterministic inputs
//! derived from the kept corpus (bit flips, interesting values, inserted
//! and deleted runs, splices of two corpus entries, truncation), so
//! `cargo test` explores around known-good inputs without libFuzzer.

/// xorshift64*: tiny, seedable, good enough to pick mutations.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

const INTERESTING: [u64; 10] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    i64::MAX as u64,
    u64::MAX,
];

/// One input derived from `corpus` (which may be empty).
pub fn mutate(rng: &mut Rng, corpus: &[Vec<u8>], max_len: usize) -> Vec<u8> {
    let mut data = if corpus.is_empty() || rng.below(8) == 0 {
        (0..rng.below(64)).map(|_| rng.next_u64() as u8).collect()
    } else {
        corpus[rng.below(corpus.len())].clone()
    };
    for _ in 0..1 + rng.below(8) {
        let len = data.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                data[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                data[i] = rng.next_u64() as u8;
            }
            2 if len > 0 => {
                // An interesting little-endian value of 1, 2, 4 or 8 bytes.
                let width = 1 << rng.below(4);
                let at = rng.below(len);
                let v = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
                for (k, b) in v.iter().take(width).enumerate() {
                    if let Some(slot) = data.get_mut(at + k) {
                        *slot = *b;
                    }
                }
            }
            3 => {
                let at = rng.below(len + 1);
                let run: Vec<u8> = (0..1 + rng.below(16))
                    .map(|_| rng.next_u64() as u8)
                    .collect();
                data.splice(at..at, run);
            }
            4 if len > 0 => {
                let at = rng.below(len);
                let end = (at + 1 + rng.below(16)).min(len);
                data.drain(at..end);
            }
            5 if !corpus.is_empty() => {
                // Splice: our head, another entry's tail.
                let other = &corpus[rng.below(corpus.len())];
                let at = rng.below(len + 1);
                let from = rng.below(other.len() + 1);
                data.truncate(at);
                data.extend_from_slice(&other[from..]);
            }
            6 if len > 0 => data.truncate(rng.below(len)),
            _ => {}
        }
    }
    data.truncate(max_len);
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_for_a_seed() {
        let corpus = vec![b"hello".to_vec(), vec![0; 40]];
        let a: Vec<Vec<u8>> = {
            let mut r = Rng::new(7);
            (0..50).map(|_| mutate(&mut r, &corpus, 100)).collect()
        };
        let mut r = Rng::new(7);
        let b: Vec<Vec<u8>> = (0..50).map(|_| mutate(&mut r, &corpus, 100)).collect();
        assert_eq!(a, b);
        assert!(a.iter().any(|d| d != &corpus[0] && d != &corpus[1]));
        assert!(a.iter().all(|d| d.len() <= 100));
    }
}
