//! PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot()` pickles) as traces.
//!
//! A snapshot is a pickled dict; its `device_traces` key holds one list of entries per device.
//! Each entry is a dict with at least `action`, `addr`, `size` and `stream` (extra keys such
//! as `frames`, `time_us`, `compile_context` are ignored). The reader takes one device's list
//! (by default the first non-empty one) and turns it into a [`Trace`]:
//!
//! * `alloc` allocates `size` bytes at `addr` on `stream`; each gets a fresh trace id.
//! * `free_requested` is the free (the moment the program dropped the tensor). The later
//!   `free_completed` of the same address (the caching allocator actually reusing it, after
//!   stream events) is ignored, so the order of frees is the program's order.
//!   Older snapshots' `free` action is treated like `free_requested`.
//! * When a snapshot holds no `free_requested` entries at all, `free_completed` is taken as
//!   the free instead. When it does, every `free_completed` is skipped (its `free_requested`
//!   came first, or fell before the recording window).
//! * A free whose address was never allocated in the trace is memory allocated before
//!   recording began: an allocation of the free's `size` on the free's stream is emitted at
//!   the start of the trace, in the order such frees appear.
//! * Frees are matched to allocations by address. Every free carries its entry's `stream`.
//! * Segment events (`segment_alloc`, `segment_map`, ...), `snapshot` and `oom` are skipped.
//!
//! Errors name the device and the entry's index in its list.
//!
//! PyTorch's own reserved memory over the recording ([`RecordedReserved`], read by
//! [`parse_snapshot_recorded`]) comes from the segment events: the snapshot's `segments`
//! list is the state at the dump, and walking the device's `segment_alloc` / `segment_map`
//! (+size) and `segment_free` / `segment_unmap` (-size) entries back from it gives the state
//! when recording began, then forward the peak.

use super::pickle::{self, Atom, DecodeError, Dict, Item, List, S, V};
use super::{Event, Trace, TraceError, MAX_BYTES};
use rustc_hash::FxHashMap;
use std::io::Read;

/// Read a snapshot pickle (already decompressed) and convert device `device`'s trace (the
/// first non-empty one when `None`).
pub fn parse_snapshot(bytes: &[u8], device: Option<usize>) -> Result<Trace, TraceError> {
    parse_snapshot_recorded(bytes, device).map(|(t, _)| t)
}

/// Like [`parse_snapshot`], plus PyTorch's own reserved bytes over the recording, when the
/// snapshot lets them be computed (see [`RecordedReserved`]).
///
/// ```
/// # let bytes = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/torch-small.pickle")).unwrap();
/// use stitch_alloc::trace::pytorch::parse_snapshot_recorded;
/// let (trace, torch) = parse_snapshot_recorded(&bytes, None).unwrap();
/// let torch = torch.expect("this snapshot has segments");
/// assert!(torch.peak_bytes >= torch.initial_bytes && torch.peak_bytes >= torch.final_bytes);
/// assert!(trace.summary().peak_live_bytes <= torch.peak_bytes);
/// ```
pub fn parse_snapshot_recorded(
    bytes: &[u8],
    device: Option<usize>,
) -> Result<(Trace, Option<RecordedReserved>), TraceError> {
    read_snapshot(bytes, device)
}

/// Like [`parse_snapshot_recorded`], decoding the pickle as it is read from `r` (a file, a
/// gzip decoder): the snapshot is never held in memory, only the entries replay needs (32
/// bytes each). A read error (a truncated or corrupt gzip stream) is a
/// [`TraceError::Snapshot`] that says so.
pub fn read_snapshot(
    r: impl Read,
    device: Option<usize>,
) -> Result<(Trace, Option<RecordedReserved>), TraceError> {
    let value = pickle::decode(r).map_err(|e| match e {
        DecodeError::Io(e) => TraceError::Snapshot(format!(
            "cannot read the snapshot (gzip stream is truncated or corrupt?): {e}"
        )),
        DecodeError::Bad(m) => TraceError::Snapshot(format!("cannot unpickle: {m}")),
    })?;
    let top = value.as_dict().ok_or_else(|| {
        TraceError::Snapshot(
            "the pickle is not a dict (expected the output of torch.cuda.memory._dump_snapshot())"
                .into(),
        )
    })?;
    let (dev, entries) = device_entries(top, device)?;
    let trace = convert(entries, dev)?;
    Ok((trace, recorded_reserved(top, dev, entries)))
}

/// Like [`parse_snapshot`], decoding the pickle as it is read from `r` (see
/// [`read_snapshot`]).
pub fn parse_snapshot_reader(r: impl Read, device: Option<usize>) -> Result<Trace, TraceError> {
    read_snapshot(r, device).map(|(t, _)| t)
}

/// The bytes PyTorch's caching allocator itself held reserved (its segments) on the device
/// whose trace is replayed: at the start of the recording, at its peak, and at the dump.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RecordedReserved {
    /// Reserved when recording began (segments made before it).
    pub initial_bytes: u64,
    /// The most reserved at once during the recording.
    pub peak_bytes: u64,
    /// Reserved at the dump (the snapshot's `segments`).
    pub final_bytes: u64,
    /// Whether the recording allocator ran with `expandable_segments:True` (its
    /// `allocator_settings` say so, or its trace maps segments instead of allocating them).
    pub expandable_segments: bool,
}

/// PyTorch's reserved bytes over device `dev`'s trace `entries`. `None` when the snapshot
/// has no `segments` list, or when its segment events do not add up (more freed than the
/// dump and the events account for).
fn recorded_reserved(top: &Dict, dev: usize, entries: &List) -> Option<RecordedReserved> {
    let segments = top.get(Atom::Segments)?.as_list()?;
    let mut final_bytes = 0u64;
    for seg in segments.iter() {
        let on_dev = seg
            .get(Atom::Device)
            .ok()?
            .and_then(S::as_u64)
            .map(|x| x as usize);
        if on_dev != Some(dev) {
            continue;
        }
        let size = seg.get(Atom::TotalSize).ok()?.and_then(S::as_u64)?;
        final_bytes = final_bytes.saturating_add(size);
    }
    // Net change of each entry: +size for segment_alloc/map, -size for segment_free/unmap.
    let mut deltas = Vec::new();
    let mut expandable = top
        .get(Atom::AllocatorSettings)
        .and_then(V::as_dict)
        .and_then(|s| s.get(Atom::ExpandableSegments))
        .is_some_and(|v| matches!(v, V::Bool(true)));
    for e in entries.iter() {
        let Ok(action) = e.get(Atom::Action) else {
            continue;
        };
        let action = match action {
            Some(S::Str(a)) => a,
            _ => None,
        };
        expandable |= action == Some(Atom::SegmentMap);
        let sign = match action {
            Some(Atom::SegmentAlloc | Atom::SegmentMap) => 1i128,
            Some(Atom::SegmentFree | Atom::SegmentUnmap) => -1i128,
            _ => continue,
        };
        let size = e.get(Atom::Size).ok()?.and_then(S::as_u64)?;
        deltas.push(sign * i128::from(size));
    }
    let net: i128 = deltas.iter().sum();
    let initial = i128::from(final_bytes) - net;
    if initial < 0 {
        return None;
    }
    let (mut cur, mut peak) = (initial, initial);
    for d in deltas {
        cur += d;
        if cur < 0 {
            return None;
        }
        peak = peak.max(cur);
    }
    let to_u64 = |x: i128| u64::try_from(x).unwrap_or(u64::MAX);
    Some(RecordedReserved {
        initial_bytes: to_u64(initial),
        peak_bytes: to_u64(peak),
        final_bytes,
        expandable_segments: expandable,
    })
}

/// The device whose trace to read (`device`, or the first non-empty one) and its entries.
fn device_entries(top: &Dict, device: Option<usize>) -> Result<(usize, &List), TraceError> {
    let traces = top
        .get(Atom::DeviceTraces)
        .ok_or_else(|| {
            TraceError::Snapshot(
                "no `device_traces` key: was memory history recording on \
                 (torch.cuda.memory._record_memory_history())?"
                    .into(),
            )
        })
        .and_then(|v| {
            v.as_list()
                .ok_or_else(|| TraceError::Snapshot("`device_traces` is not a list".into()))
        })?;
    let dev = match device {
        Some(d) if d < traces.len() => d,
        Some(d) => {
            return Err(TraceError::Snapshot(format!(
                "device {d} asked for, but the snapshot has traces for {} device(s)",
                traces.len()
            )))
        }
        None => traces
            .iter()
            .position(|t| t.as_list().is_some_and(|l| !l.is_empty()))
            .ok_or_else(|| TraceError::Snapshot("every device trace is empty".into()))?,
    };
    let entries = traces
        .item(dev)
        .as_list()
        .ok_or_else(|| TraceError::Snapshot(format!("device_traces[{dev}] is not a list")))?;
    Ok((dev, entries))
}

#[derive(Copy, Clone)]
struct Entry {
    action: Atom,
    addr: u64,
    size: u64,
    stream: u64,
}

fn entry(item: Item<'_>, dev: usize, index: usize) -> Result<Option<Entry>, TraceError> {
    let err = |message: String| TraceError::SnapshotEvent {
        device: dev,
        index,
        message,
    };
    let e = item
        .entry()
        .ok_or_else(|| err("entry is not a dict".into()))?;
    let action = match e.get(Atom::Action) {
        Some(S::Str(a)) => a,
        _ => return Err(err("missing or non-string `action`".into())),
    };
    let action = match action {
        Some(a @ (Atom::Alloc | Atom::FreeRequested | Atom::FreeCompleted | Atom::Free)) => a,
        _ => return Ok(None),
    };
    let name = action.name();
    let field = |key: Atom| -> Result<u64, TraceError> {
        let k = key.name();
        let v = e
            .get(key)
            .ok_or_else(|| err(format!("`{name}` entry has no `{k}`")))?;
        v.as_u64()
            .ok_or_else(|| err(format!("`{k}` is not a non-negative integer: {v}")))
    };
    let addr = field(Atom::Addr)?;
    let size = field(Atom::Size)?;
    // Stream 0 when absent (very old snapshots record none).
    let stream = match e.get(Atom::Stream) {
        None | Some(S::None) => 0,
        Some(s) => s
            .as_u64()
            .ok_or_else(|| err(format!("`stream` is not an integer: {s}")))?,
    };
    Ok(Some(Entry {
        action,
        addr,
        size,
        stream,
    }))
}

fn convert(entries: &List, dev: usize) -> Result<Trace, TraceError> {
    // First every entry is checked, in order (so the first bad entry is reported whatever
    // the conversion below finds), and whether any free_requested was recorded.
    let mut has_requested = false;
    for (i, item) in entries.iter().enumerate() {
        if let Some(e) = entry(item, dev, i)? {
            has_requested |= matches!(e.action, Atom::FreeRequested | Atom::Free);
        }
    }
    let mut next_id = 0u64;
    let mut pre = Vec::new();
    let mut body = Vec::with_capacity(entries.len());
    // addr -> (id, size) of live allocations
    let mut live: FxHashMap<u64, (u64, u64)> = FxHashMap::default();
    for (index, item) in entries.iter().enumerate() {
        let Some(e) = entry(item, dev, index)? else {
            continue;
        };
        let err = |message: String| TraceError::SnapshotEvent {
            device: dev,
            index,
            message,
        };
        if e.size > MAX_BYTES {
            return Err(err(format!("absurd size {}", e.size)));
        }
        let is_free = match e.action {
            Atom::Alloc => {
                if e.size == 0 {
                    return Err(err("allocation of 0 bytes".into()));
                }
                if live.contains_key(&e.addr) {
                    return Err(err(format!(
                        "allocation at {:#x}, which is still live (no free recorded for it)",
                        e.addr
                    )));
                }
                let id = next_id;
                next_id += 1;
                live.insert(e.addr, (id, e.size));
                body.push(Event::Alloc {
                    id,
                    bytes: e.size,
                    stream: e.stream,
                });
                false
            }
            Atom::FreeRequested | Atom::Free => true,
            Atom::FreeCompleted if !has_requested => true,
            // free_completed when free_requested entries exist: the logical free is the
            // free_requested (already taken, or before the recording window).
            _ => false,
        };
        if !is_free {
            continue;
        }
        let id = match live.remove(&e.addr) {
            Some((id, _)) => id,
            None => {
                // Allocated before recording began.
                if e.size == 0 {
                    return Err(err(format!(
                        "free at {:#x} of memory allocated before recording, but its size is 0",
                        e.addr
                    )));
                }
                let id = next_id;
                next_id += 1;
                pre.push(Event::Alloc {
                    id,
                    bytes: e.size,
                    stream: e.stream,
                });
                id
            }
        };
        body.push(Event::Free {
            id,
            stream: Some(e.stream),
        });
    }
    pre.extend(body);
    Ok(Trace { events: pre })
}
