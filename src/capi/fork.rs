//! Fork (issue #13, item 6): a child process inherits the runtime, allocators whose CUDA
//! memory and contexts belong to the parent, and possibly a lock that a parent thread held at
//! the fork (and that nobody in the child will release). So once the runtime exists, a
//! `pthread_atfork` handler marks the child, and every call there fails at once with
//! [`FORKED`], before it touches any lock: a clear error, never a hang.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

/// The error of every call in a forked child.
pub(super) const FORKED: &str = "stitch-alloc used in a forked child; CUDA memory of the \
     parent is not usable (every call fails in this process: allocate in the parent, or start \
     the child with spawn/exec)";

/// Set in a child forked after [`register`] (by the atfork handler, in the child only).
static IN_CHILD: AtomicBool = AtomicBool::new(false);
/// Whether the child has said [`FORKED`] on stderr.
static SAID: AtomicBool = AtomicBool::new(false);

extern "C" fn mark_child() {
    IN_CHILD.store(true, Ordering::Relaxed);
}

/// Install the atfork handler (once per process; called when the runtime is created).
pub(super) fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: `mark_child` is async-signal-safe (one atomic store) and takes no
        // arguments, as a child handler must. It stays callable for the life of the process:
        // the library is not unloaded once its thread-locals are in use (glibc keeps a
        // library with thread-local destructors loaded), and neither torch nor ctypes
        // closes it.
        let r = unsafe { libc::pthread_atfork(None, None, Some(mark_child)) };
        if r != 0 {
            tracing::warn!(
                code = r,
                "pthread_atfork failed: a forked child is not detected"
            );
        }
    });
}

/// Whether this process is a child forked after the runtime was created.
pub(super) fn in_child() -> bool {
    IN_CHILD.load(Ordering::Relaxed)
}

/// Say [`FORKED`] on stderr, once per child, with `write(2)`: no lock (a parent thread may
/// have held stderr's lock, or the log's, at the fork).
pub(super) fn say_once() {
    if SAID.swap(true, Ordering::Relaxed) {
        return;
    }
    let msg = format!("stitch-alloc: {FORKED}\n");
    // SAFETY: writes `len` bytes of a live buffer to file descriptor 2; a failed or short
    // write only loses the message.
    let _ = unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}
