//! The bodies of the exports, each on a given [`Runtime`] (the exports pass the process's;
//! unit tests their own, with drivers they control). Pointers arrive as integers: nothing
//! here reads through one.
#![forbid(unsafe_code)]

use super::capture::CAPTURE_UNSUPPORTED;
use super::conf::OnOom;
use super::guard::{describe, first_time, report};
use super::runtime::Runtime;
use super::stats::DeviceStats;
use crate::driver::Driver;
use crate::{AllocError, DevicePtr, Stream};
use std::ffi::c_int;
use std::sync::atomic::Ordering;

/// `stitch_malloc`: the address, or 0 on failure (reported).
pub(super) fn malloc(rt: &Runtime, size: usize, device: c_int, stream: Stream) -> u64 {
    rt.api.time(|| {
        malloc_by(rt, "stitch_malloc", size, device, stream, |a, n, s| {
            a.alloc(n, s)
        })
    })
}

/// `stitch_malloc_one_handle`: as [`malloc`], the memory inside one physical handle
/// (`Allocator::alloc_one_handle`).
pub(super) fn malloc_one_handle(rt: &Runtime, size: usize, device: c_int, stream: Stream) -> u64 {
    malloc_by(
        rt,
        "stitch_malloc_one_handle",
        size,
        device,
        stream,
        |a, n, s| a.alloc_one_handle(n, s),
    )
}

/// The body of the allocation exports: `alloc` on the device's allocator, with the zero
/// size, capture and error rules of `stitch_malloc`.
fn malloc_by(
    rt: &Runtime,
    func: &'static str,
    size: usize,
    device: c_int,
    stream: Stream,
    alloc: impl FnOnce(&super::runtime::Alloc, u64, Stream) -> Result<DevicePtr, AllocError>,
) -> u64 {
    let fail = |level, m: &str| {
        report(level, &format!("{func}(size={size}, device={device}): {m}"));
        0
    };
    let r = rt.with_alloc(func, device, |a, slot| {
        release_held(a, slot, None);
        if size == 0 {
            // Torch asks for zero bytes for every empty tensor: NULL, without a warning and
            // without replacing the thread's last error (an out-of-memory diagnosis a user is
            // told to read must survive the empty tensors allocated after it).
            tracing::debug!(device, "{func}: zero-size allocation");
            return Ok(0);
        }
        match a.driver().stream_capturing(stream) {
            Ok(false) => {}
            Ok(true) => return Err((tracing::Level::ERROR, CAPTURE_UNSUPPORTED.to_string())),
            Err(e) => {
                return Err((
                    tracing::Level::WARN,
                    format!("could not ask whether the stream is capturing a CUDA graph: {e}"),
                ))
            }
        }
        match a.driver().meter().scoped(|| alloc(a, size as u64, stream)) {
            Ok(p) => Ok(p.addr()),
            Err(e) => Err((tracing::Level::WARN, describe_oom(rt, size, device, &e))),
        }
    });
    match r {
        Ok(Ok(p)) => p,
        Ok(Err((level, m))) => fail(level, &m),
        Err(m) => fail(first_time(&m), &m),
    }
}

/// An allocation error in words; with `on_oom:abort`, an out-of-memory error aborts here.
fn describe_oom(rt: &Runtime, size: usize, device: c_int, e: &AllocError) -> String {
    let oom = matches!(e, AllocError::OutOfMemory(_) | AllocError::TooLarge { .. });
    if oom && rt.conf().is_ok_and(|c| c.abi.on_oom == OnOom::Abort) {
        eprintln!(
            "stitch-alloc: stitch_malloc(size={size}, device={device}): {}; \
             aborting (on_oom:abort)",
            describe(e)
        );
        std::process::abort();
    }
    describe(e)
}

/// `stitch_free`.
pub(super) fn free(rt: &Runtime, addr: u64, size: usize, device: c_int, stream: Stream) {
    rt.api.time(|| free_timed(rt, addr, size, device, stream))
}

/// The body of [`free`], timed by it.
fn free_timed(rt: &Runtime, addr: u64, size: usize, device: c_int, stream: Stream) {
    let report_at = |level, m: &str| {
        report(
            level,
            &format!("stitch_free(ptr={addr:#x}, size={size}, device={device}): {m}"),
        )
    };
    let fail = |m: &str| report_at(tracing::Level::WARN, m);
    if addr == 0 {
        return fail("null pointer");
    }
    if rt.conf().is_ok() && !rt.resolved() {
        // No allocation was made, so the pointer is not ours; the driver stays untouched.
        return fail("invalid pointer: no allocation was made by this library yet");
    }
    let r = rt.with_alloc("stitch_free", device, |a, slot| {
        release_held(a, slot, None);
        if slot.held.holds(addr) {
            return fail(
                "freed already, during a CUDA graph capture (the block is held until that \
                 capture has ended); not freed",
            );
        }
        let check_size = |usable: u64| {
            if size != 0 && size as u64 > usable {
                fail(&format!(
                    "size {size} exceeds the allocation's {usable} bytes (freed anyway)"
                ));
            }
        };
        // A query that fails is taken as a capture: holding a block is safe, reusing one
        // that a graph still uses is not.
        let capturing = a.driver().stream_capturing(stream).unwrap_or(true);
        if capturing {
            if let Some(usable) = a.usable_size(DevicePtr(addr)) {
                check_size(usable);
                slot.held.hold(addr, usable, stream);
                tracing::debug!(
                    addr,
                    "stitch_free on a capturing stream: held until the capture has ended"
                );
                return;
            }
        }
        // One lookup under one lock: the free returns the block's usable size for the check.
        match a.free_sized(DevicePtr(addr), stream) {
            Ok(usable) => check_size(usable),
            Err(e @ AllocError::InvalidPointer { .. }) => match rt.owner_of(addr) {
                Some(other) => fail(&format!(
                    "the pointer belongs to device {other}, not {device}; not freed"
                )),
                None => fail(&describe(&e)),
            },
            Err(e) => fail(&describe(&e)),
        }
    });
    if let Err(m) = r {
        report_at(first_time(&m), &m);
    }
}

/// Free the blocks held since a free on a capturing stream ([`super::capture`]) whose
/// capture has ended, and those of `retired` (a stream about to be destroyed: its capture is
/// over, and it must not be queried after). Each is freed on its own stream.
fn release_held(a: &super::runtime::Alloc, slot: &super::runtime::Slot, retired: Option<Stream>) {
    let ready = slot.held.take_ready(
        |s| a.driver().stream_capturing(s).unwrap_or(true),
        |s| Some(s) == retired,
    );
    for (addr, stream) in ready {
        if let Err(e) = a.free(DevicePtr(addr), stream) {
            report(
                tracing::Level::WARN,
                &format!(
                    "releasing a block held during a CUDA graph capture: {}",
                    describe(&e)
                ),
            );
        }
    }
}

/// A C status: 0, or -1 with the error reported (at `level` of it) as `"{call}: {error}"`.
pub(super) fn status(
    r: Result<(), String>,
    level: impl FnOnce(&str) -> tracing::Level,
    call: impl FnOnce() -> String,
) -> c_int {
    match r {
        Ok(()) => 0,
        Err(m) => {
            report(level(&m), &format!("{}: {m}", call()));
            -1
        }
    }
}

/// `stitch_segment_log`: 0, or -1 for a device out of range (reported).
pub(super) fn segment_log(rt: &Runtime, device: c_int, on: bool) -> c_int {
    status(
        rt.want_segments(device, on),
        |_| tracing::Level::WARN,
        || format!("stitch_segment_log(device={device})"),
    )
}

/// `stitch_segment_events`: the oldest events of `device`, at most `max`; `Err` with the
/// reason (reported) for a device out of range.
pub(super) fn segment_events(
    rt: &Runtime,
    device: c_int,
    max: usize,
) -> Result<Vec<super::segments::SegmentEvent>, ()> {
    rt.drain_segments(device, max).map_err(|m| {
        report(
            tracing::Level::WARN,
            &format!("stitch_segment_events(device={device}): {m}"),
        );
    })
}

/// `stitch_init`.
pub(super) fn init(rt: &Runtime, device_count: c_int) {
    rt.init_count.store(device_count, Ordering::Relaxed);
    match rt.backend() {
        Ok(b) => tracing::debug!(device_count, backend = b.name(), "stitch_init"),
        // Already printed to stderr when the configuration was read.
        Err(e) => report(tracing::Level::DEBUG, &format!("stitch_init: {e}")),
    }
}

/// `stitch_reset`: every device with an allocator; a poisoned one is reported.
pub(super) fn reset(rt: &Runtime) {
    for d in 0..rt.devices() {
        if let Some(p) = rt.poisoned(d) {
            report(first_time(p), &format!("stitch_reset: {p}"));
        } else if rt.existing(d).is_some() {
            let r = rt.with_alloc("stitch_reset", d as c_int, |a, slot| {
                release_held(a, slot, None);
                a.empty_cache()
            });
            if let Ok(Err(e)) = r {
                report(
                    tracing::Level::WARN,
                    &format!("stitch_reset: device {d}: {e}"),
                );
            }
        }
    }
}

/// `stitch_empty_cache`: 0, or -1 on error.
pub(super) fn empty_cache(rt: &Runtime, device: c_int) -> c_int {
    let fail = |m: &str| {
        report(
            tracing::Level::WARN,
            &format!("stitch_empty_cache(device={device}): {m}"),
        );
        -1
    };
    if let Err(m) = rt.check_device(device) {
        return fail(&m);
    }
    if let Some(p) = rt.poisoned(device as usize) {
        return fail(p);
    }
    if rt.existing(device as usize).is_none() {
        return 0; // nothing to release (and no driver is touched)
    }
    match rt.with_alloc("stitch_empty_cache", device, |a, slot| {
        release_held(a, slot, None);
        a.empty_cache()
    }) {
        Ok(Ok(_)) => 0,
        Ok(Err(e)) => fail(&e.to_string()),
        Err(m) => fail(&m),
    }
}

/// `stitch_retire_stream`: fence the frees made on `stream` and wait for them, so the
/// caller may destroy the stream; 0, or -1 with the reason reported.
pub(super) fn retire_stream(rt: &Runtime, device: c_int, stream: Stream) -> c_int {
    let fail = |m: &str| {
        report(
            tracing::Level::WARN,
            &format!(
                "stitch_retire_stream(device={device}, stream={:#x}): {m}",
                stream.raw()
            ),
        );
        -1
    };
    if let Err(m) = rt.check_device(device) {
        return fail(&m);
    }
    if let Some(p) = rt.poisoned(device as usize) {
        return fail(p);
    }
    if rt.existing(device as usize).is_none() {
        return 0; // nothing was freed on it (and no driver is touched)
    }
    match rt.with_alloc("stitch_retire_stream", device, |a, slot| {
        release_held(a, slot, Some(stream));
        a.retire_stream(stream)
    }) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => fail(&e.to_string()),
        Err(m) => fail(&m),
    }
}

/// `stitch_memory_fraction`: refused loudly (ERROR, and the last error) once the device has
/// its allocator.
pub(super) fn memory_fraction(rt: &Runtime, fraction: f64, device: c_int) {
    if let Err(m) = rt.set_fraction(fraction, device) {
        report(
            tracing::Level::ERROR,
            &format!("stitch_memory_fraction(fraction={fraction}, device={device}): {m}"),
        );
    }
}

/// `stitch_record_stream`.
pub(super) fn record_stream(rt: &Runtime, addr: u64, stream: Stream) {
    let report_at =
        |level, m: &str| report(level, &format!("stitch_record_stream(ptr={addr:#x}): {m}"));
    let fail = |m: &str| report_at(tracing::Level::WARN, m);
    if let Err(m) = rt.conf() {
        return report_at(first_time(&m), &m);
    }
    let Some(d) = rt.owner_of(addr) else {
        return match (0..rt.devices()).find_map(|d| rt.poisoned(d)) {
            Some(p) => fail(&format!("not a live allocation of a usable device ({p})")),
            None => fail("not a live allocation of this library"),
        };
    };
    let r = rt.with_alloc("stitch_record_stream", d as c_int, |a, _| {
        a.record_stream(DevicePtr(addr), stream)
    });
    match r {
        Ok(Ok(())) => {}
        Ok(Err(e)) => fail(&describe(&e)),
        Err(m) => fail(&m),
    }
}

/// `stitch_stats_json`: the document, or an error (reported).
pub(super) fn stats_json(rt: &Runtime, device: c_int) -> Option<String> {
    match rt.stats_json(device) {
        Ok(s) => Some(s),
        Err(m) => {
            report(
                tracing::Level::WARN,
                &format!("stitch_stats_json(device={device}): {m}"),
            );
            None
        }
    }
}

/// `stitch_device_stats`: the figures, or an error (reported).
pub(super) fn device_stats(rt: &Runtime, device: c_int) -> Option<DeviceStats> {
    match rt.device_stats(device) {
        Ok(s) => Some(s),
        Err(m) => {
            report(
                first_time(&m),
                &format!("stitch_device_stats(device={device}): {m}"),
            );
            None
        }
    }
}

/// `stitch_reset_peak_stats` (`accumulated` false) and `stitch_reset_accumulated_stats`:
/// 0, or -1 on error (reported).
pub(super) fn reset_stats(rt: &Runtime, device: c_int, accumulated: bool) -> c_int {
    let func = if accumulated {
        "stitch_reset_accumulated_stats"
    } else {
        "stitch_reset_peak_stats"
    };
    let r = rt.if_created(func, device, |a| {
        if accumulated {
            a.reset_accumulated_stats()
        } else {
            a.reset_peak_stats()
        }
    });
    status(r, first_time, || format!("{func}(device={device})"))
}

/// `stitch_set_memory_fraction`: 0, or -1 on error (reported).
pub(super) fn set_memory_fraction(rt: &Runtime, device: c_int, fraction: f64) -> c_int {
    status(
        rt.set_fraction(fraction, device),
        |_| tracing::Level::WARN,
        || format!("stitch_set_memory_fraction(device={device}, fraction={fraction})"),
    )
}

/// `stitch_get_memory_fraction`: the fraction last set, 1.0 if none, -1.0 on error.
pub(super) fn get_memory_fraction(rt: &Runtime, device: c_int) -> f64 {
    match rt.fraction(device) {
        Ok(f) => f.unwrap_or(1.0),
        Err(m) => {
            report(
                first_time(&m),
                &format!("stitch_get_memory_fraction(device={device}): {m}"),
            );
            -1.0
        }
    }
}

/// `stitch_malloc_graph`: the address, or 0 on failure (reported). Allowed on a capturing
/// stream: clean or new memory only, no event on any stream, the driver in relaxed capture
/// mode ([`crate::Allocator::alloc_clean`]).
pub(super) fn malloc_graph(rt: &Runtime, size: usize, device: c_int, stream: Stream) -> u64 {
    let fail = |level, m: &str| {
        report(
            level,
            &format!("stitch_malloc_graph(size={size}, device={device}): {m}"),
        );
        0
    };
    if size == 0 {
        return 0;
    }
    let r = rt.with_alloc("stitch_malloc_graph", device, |a, _| {
        a.alloc_clean(size as u64, stream)
            .map(|p| p.addr())
            .map_err(|e| describe_oom(rt, size, device, &e))
    });
    match r {
        Ok(Ok(p)) => p,
        Ok(Err(m)) => fail(tracing::Level::WARN, &m),
        Err(m) => fail(first_time(&m), &m),
    }
}

/// `stitch_free_graph`: 0, or -1 on error (reported).
pub(super) fn free_graph(rt: &Runtime, addr: u64, device: c_int) -> c_int {
    let fail = |m: &str| {
        report(
            tracing::Level::WARN,
            &format!("stitch_free_graph(ptr={addr:#x}, device={device}): {m}"),
        );
        -1
    };
    if addr == 0 {
        return fail("null pointer");
    }
    match rt.with_alloc("stitch_free_graph", device, |a, _| {
        a.free_clean(DevicePtr(addr))
    }) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => fail(&describe(&e)),
        Err(m) => fail(&m),
    }
}
