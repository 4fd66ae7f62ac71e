//! `wasi:random/insecure-seed`, from the proxy world's `wasi:random/random`.

use crate::Virt;
use crate::bindings::exports::wasi::random::insecure_seed;
use crate::bindings::wasi::random::random;

/// A seed for hash tables' DoS resistance: random bytes are the best seed there is, and the
/// proxy world has them.
impl insecure_seed::Guest for Virt {
    fn insecure_seed() -> (u64, u64) {
        (random::get_random_u64(), random::get_random_u64())
    }
}
