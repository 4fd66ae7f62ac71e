//! What std gives a wasm32-wasip2 component and this `no_std` one must give itself: an
//! allocator, the canonical ABI's `cabi_realloc` (wasi-libc's otherwise), and a panic handler.

use alloc::alloc::{Layout, alloc, realloc};
use core::sync::atomic::{AtomicBool, Ordering};

/// The allocator of the lists and strings that cross the component's boundary.
#[global_allocator]
static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

/// Where a caller of the component puts the lists and strings it passes in (and where
/// `post-return` frees them from): a new block when `old_len` is 0, else `old_ptr` resized.
/// Out of memory is a trap, as the canonical ABI has no way to report it.
#[unsafe(no_mangle)]
unsafe extern "C" fn cabi_realloc(
    old_ptr: *mut u8,
    old_len: usize,
    align: usize,
    new_len: usize,
) -> *mut u8 {
    if old_len == 0 && new_len == 0 {
        // A zero-sized block needs no memory, only a well-aligned address.
        return align as *mut u8;
    }
    // The canonical ABI passes a power-of-two `align` and, with `old_len`, the layout that
    // `old_ptr` was allocated with.
    let ptr = unsafe {
        if old_len == 0 {
            alloc(Layout::from_size_align_unchecked(new_len, align))
        } else {
            realloc(old_ptr, Layout::from_size_align_unchecked(old_len, align), new_len)
        }
    };
    if ptr.is_null() {
        core::arch::wasm32::unreachable();
    }
    ptr
}

/// A panic's end: its message on `wasi:cli/stderr`, then a trap. A panic inside it (the message
/// cannot be allocated, say) traps at once.
#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    /// Set by the first panic, so that a second one does not recurse.
    static PANICKING: AtomicBool = AtomicBool::new(false);

    if !PANICKING.swap(true, Ordering::Relaxed) {
        let message = alloc::format!("wisp-virt: {info}\n");
        // An error writing it leaves nothing better to do than to trap anyway.
        let stderr = crate::bindings::wasi::cli::stderr::get_stderr();
        let _ = stderr.blocking_write_and_flush(message.as_bytes());
    }
    core::arch::wasm32::unreachable()
}
