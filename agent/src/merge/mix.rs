//! The one 64-bit mixer the merge derives its ids from (track uuids, flow
//! ids, collective keys): splitmix64's finalizer, so nearby inputs (a
//! node's salt plus a small uuid, a sequence number) give far-apart ids.
//! On its own so the id maps and the collective matcher share it without
//! importing each other.

pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
