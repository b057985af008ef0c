//! Nothing crosses the C boundary as a panic ([`guard`]), and every failure is logged and
//! kept as the calling thread's last error ([`report`], read by `stitch_last_error`).
#![forbid(unsafe_code)]

use crate::AllocError;
use parking_lot::Mutex;
use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    /// The thread's last error message (empty: none since the thread started or the last
    /// `stitch_clear_error`). Replaced, never mutated in place, so a pointer handed out stays
    /// valid until the next report on this thread.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// The thread's last error as a C string owned by the library, or `""`.
pub(super) fn last_error_ptr() -> *const c_char {
    static EMPTY: &CStr = c"";
    LAST_ERROR
        .try_with(|e| e.borrow().as_ptr())
        .unwrap_or(EMPTY.as_ptr())
}

/// Forget the thread's last error.
pub(super) fn clear_error() {
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = CString::default());
}

/// `s` as a C string (an interior NUL is written as `\0`).
pub(super) fn to_cstring(s: &str) -> CString {
    CString::new(s.replace('\0', "\\0")).unwrap_or_default()
}

/// WARN the first time a standing condition (an invalid configuration, a device that could
/// not be opened, a device out of range) is met, DEBUG after: torch allocates thousands of
/// times a second, and one line says it all. Every call still sets the last error.
pub(super) fn first_time(condition: &str) -> tracing::Level {
    /// The conditions seen, at most 64 (beyond, every one is new: WARN).
    static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock();
    if seen.iter().any(|s| s == condition) {
        return tracing::Level::DEBUG;
    }
    if seen.len() < 64 {
        seen.push(condition.to_string());
    }
    tracing::Level::WARN
}

/// Log `msg` at `level` and keep it as this thread's last error.
pub(super) fn report(level: tracing::Level, msg: &str) {
    match level {
        tracing::Level::ERROR => tracing::error!("{msg}"),
        tracing::Level::WARN => tracing::warn!("{msg}"),
        tracing::Level::INFO => tracing::info!("{msg}"),
        _ => tracing::debug!("{msg}"),
    }
    set_last_error(msg);
}

/// Keep `msg` as this thread's last error, without logging it (no lock is taken: usable in
/// a forked child).
pub(super) fn set_last_error(msg: &str) {
    let c = to_cstring(msg);
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

/// The message of a caught panic.
pub(super) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}

/// Run `f`; a panic becomes an error report and `fallback`.
pub(super) fn guard<T>(func: &'static str, fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let _ = catch_unwind(AssertUnwindSafe(|| {
                report(
                    tracing::Level::ERROR,
                    &format!("{func}: internal error (panic): {}", panic_message(&*p)),
                )
            }));
            fallback
        }
    }
}

/// An allocation error in words, led by its kind.
pub(super) fn describe(e: &AllocError) -> String {
    match e {
        AllocError::TooLarge { .. } => format!("request too large: {e}"),
        _ => e.to_string(),
    }
}

/// The thread's last error, as a string (unit tests).
#[cfg(test)]
pub(super) fn last_error() -> String {
    LAST_ERROR.with(|e| e.borrow().to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        last_error()
    }

    #[test]
    fn guard_turns_panics_into_errors() {
        let r = guard("test_fn", 7, || -> i32 { panic!("boom") });
        assert_eq!(r, 7);
        let msg = last();
        assert!(msg.contains("test_fn") && msg.contains("boom"), "{msg}");
        clear_error();
        assert!(last().is_empty());
        assert_eq!(guard("test_fn", 7, || 3), 3);
    }

    #[test]
    fn describe_names_too_large() {
        let e = AllocError::TooLarge {
            requested: u64::MAX,
            limit: 1,
        };
        assert!(describe(&e).starts_with("request too large"));
        assert!(to_cstring("a\0b").to_str().unwrap().contains("a\\0b"));
    }

    #[test]
    fn first_time_warns_once() {
        assert_eq!(first_time("guard test condition"), tracing::Level::WARN);
        assert_eq!(first_time("guard test condition"), tracing::Level::DEBUG);
    }
}
