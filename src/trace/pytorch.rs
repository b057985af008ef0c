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

use super::{Event, Trace, TraceError, MAX_BYTES};
use rustc_hash::FxHashMap;
use serde_pickle::{DeOptions, HashableValue, Value};
use std::collections::BTreeMap;

fn key_str(k: &HashableValue) -> Option<&str> {
    match k {
        HashableValue::String(s) => Some(s),
        HashableValue::Bytes(b) => std::str::from_utf8(b).ok(),
        _ => None,
    }
}

fn get<'a>(d: &'a BTreeMap<HashableValue, Value>, name: &str) -> Option<&'a Value> {
    // Fast path: string key.
    if let Some(v) = d.get(&HashableValue::String(name.to_string())) {
        return Some(v);
    }
    d.iter()
        .find(|(k, _)| key_str(k) == Some(name))
        .map(|(_, v)| v)
}

fn as_str(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s),
        Value::Bytes(b) => std::str::from_utf8(b).ok(),
        _ => None,
    }
}

/// An integer field as `u64`; negative values and non-integers are `None`. Streams may be
/// pointers above `i64::MAX` in theory, so big integers are accepted when they fit.
fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::I64(i) => u64::try_from(*i).ok(),
        Value::Int(b) => b.to_string().parse().ok(),
        Value::Bool(b) => Some(u64::from(*b)),
        _ => None,
    }
}

fn as_list(v: &Value) -> Option<&[Value]> {
    match v {
        Value::List(l) | Value::Tuple(l) => Some(l),
        _ => None,
    }
}

/// Read a snapshot pickle (already decompressed) and convert device `device`'s trace (the
/// first non-empty one when `None`).
pub fn parse_snapshot(bytes: &[u8], device: Option<usize>) -> Result<Trace, TraceError> {
    from_value(&unpickle(bytes)?, device)
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
    let value = unpickle(bytes)?;
    let trace = from_value(&value, device)?;
    Ok((trace, recorded_reserved(&value, device)?))
}

fn unpickle(bytes: &[u8]) -> Result<Value, TraceError> {
    // A decoder copies an object at every reference to it: refuse reference bombs first.
    super::pickle_guard::check_expansion(bytes)
        .map_err(|e| TraceError::Snapshot(format!("cannot unpickle: {e}")))?;
    serde_pickle::value_from_slice(
        bytes,
        DeOptions::new()
            .replace_unresolved_globals()
            .replace_recursive_structures(),
    )
    .map_err(|e| TraceError::Snapshot(format!("cannot unpickle: {e}")))
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

/// PyTorch's reserved bytes over device `device`'s trace (the same device [`from_value`]
/// picks). `None` when the snapshot has no `segments` list, or when its segment events do
/// not add up (more freed than the dump and the events account for).
pub fn recorded_reserved(
    value: &Value,
    device: Option<usize>,
) -> Result<Option<RecordedReserved>, TraceError> {
    let Value::Dict(top) = value else {
        return Ok(None);
    };
    let (dev, entries) = device_entries(top, device)?;
    let Some(segments) = get(top, "segments").and_then(as_list) else {
        return Ok(None);
    };
    let mut final_bytes = 0u64;
    for seg in segments {
        let Value::Dict(d) = seg else { return Ok(None) };
        let on_dev = get(d, "device").and_then(as_u64).map(|x| x as usize);
        if on_dev != Some(dev) {
            continue;
        }
        let Some(size) = get(d, "total_size").and_then(as_u64) else {
            return Ok(None);
        };
        final_bytes = final_bytes.saturating_add(size);
    }
    // Net change of each entry: +size for segment_alloc/map, -size for segment_free/unmap.
    let mut deltas = Vec::new();
    let mut expandable = get(top, "allocator_settings")
        .and_then(|v| match v {
            Value::Dict(s) => get(s, "expandable_segments"),
            _ => None,
        })
        .is_some_and(|v| matches!(v, Value::Bool(true)));
    for e in entries {
        let Value::Dict(d) = e else { continue };
        let action = get(d, "action").and_then(as_str);
        expandable |= action == Some("segment_map");
        let sign = match action {
            Some("segment_alloc" | "segment_map") => 1i128,
            Some("segment_free" | "segment_unmap") => -1i128,
            _ => continue,
        };
        let Some(size) = get(d, "size").and_then(as_u64) else {
            return Ok(None);
        };
        deltas.push(sign * i128::from(size));
    }
    let net: i128 = deltas.iter().sum();
    let initial = i128::from(final_bytes) - net;
    if initial < 0 {
        return Ok(None);
    }
    let (mut cur, mut peak) = (initial, initial);
    for d in deltas {
        cur += d;
        if cur < 0 {
            return Ok(None);
        }
        peak = peak.max(cur);
    }
    let to_u64 = |x: i128| u64::try_from(x).unwrap_or(u64::MAX);
    Ok(Some(RecordedReserved {
        initial_bytes: to_u64(initial),
        peak_bytes: to_u64(peak),
        final_bytes,
        expandable_segments: expandable,
    }))
}

/// The device whose trace to read (`device`, or the first non-empty one) and its entries.
fn device_entries(
    top: &BTreeMap<HashableValue, Value>,
    device: Option<usize>,
) -> Result<(usize, &[Value]), TraceError> {
    let traces = get(top, "device_traces")
        .ok_or_else(|| {
            TraceError::Snapshot(
                "no `device_traces` key: was memory history recording on \
                 (torch.cuda.memory._record_memory_history())?"
                    .into(),
            )
        })
        .and_then(|v| {
            as_list(v).ok_or_else(|| TraceError::Snapshot("`device_traces` is not a list".into()))
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
            .position(|t| as_list(t).is_some_and(|l| !l.is_empty()))
            .ok_or_else(|| TraceError::Snapshot("every device trace is empty".into()))?,
    };
    let entries = as_list(&traces[dev])
        .ok_or_else(|| TraceError::Snapshot(format!("device_traces[{dev}] is not a list")))?;
    Ok((dev, entries))
}

/// Convert an already unpickled snapshot (see [`parse_snapshot`]).
pub fn from_value(value: &Value, device: Option<usize>) -> Result<Trace, TraceError> {
    let Value::Dict(top) = value else {
        return Err(TraceError::Snapshot(
            "the pickle is not a dict (expected the output of torch.cuda.memory._dump_snapshot())"
                .into(),
        ));
    };
    let (dev, entries) = device_entries(top, device)?;
    convert(entries, dev)
}

struct Entry<'a> {
    action: &'a str,
    addr: u64,
    size: u64,
    stream: u64,
}

fn entry(v: &Value, dev: usize, index: usize) -> Result<Option<Entry<'_>>, TraceError> {
    let err = |message: String| TraceError::SnapshotEvent {
        device: dev,
        index,
        message,
    };
    let Value::Dict(d) = v else {
        return Err(err("entry is not a dict".into()));
    };
    let action = get(d, "action")
        .and_then(as_str)
        .ok_or_else(|| err("missing or non-string `action`".into()))?;
    if !matches!(
        action,
        "alloc" | "free_requested" | "free_completed" | "free"
    ) {
        return Ok(None);
    }
    let field = |name: &str| -> Result<u64, TraceError> {
        let v = get(d, name).ok_or_else(|| err(format!("`{action}` entry has no `{name}`")))?;
        as_u64(v).ok_or_else(|| err(format!("`{name}` is not a non-negative integer: {v:?}")))
    };
    let addr = field("addr")?;
    let size = field("size")?;
    // Stream 0 when absent (very old snapshots record none).
    let stream = match get(d, "stream") {
        None | Some(Value::None) => 0,
        Some(s) => as_u64(s).ok_or_else(|| err(format!("`stream` is not an integer: {s:?}")))?,
    };
    Ok(Some(Entry {
        action,
        addr,
        size,
        stream,
    }))
}

fn convert(entries: &[Value], dev: usize) -> Result<Trace, TraceError> {
    let parsed: Vec<Option<Entry<'_>>> = entries
        .iter()
        .enumerate()
        .map(|(i, v)| entry(v, dev, i))
        .collect::<Result<_, _>>()?;
    let has_requested = parsed
        .iter()
        .flatten()
        .any(|e| matches!(e.action, "free_requested" | "free"));
    let mut next_id = 0u64;
    let mut pre = Vec::new();
    let mut body = Vec::with_capacity(parsed.len());
    // addr -> (id, size) of live allocations
    let mut live: FxHashMap<u64, (u64, u64)> = FxHashMap::default();
    for (index, e) in parsed.iter().enumerate() {
        let Some(e) = e else { continue };
        let err = |message: String| TraceError::SnapshotEvent {
            device: dev,
            index,
            message,
        };
        if e.size > MAX_BYTES {
            return Err(err(format!("absurd size {}", e.size)));
        }
        let is_free = match e.action {
            "alloc" => {
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
            "free_requested" | "free" => true,
            "free_completed" if !has_requested => true,
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
