//! Allocation traces: the event model, the plain text format (optionally gzipped), PyTorch
//! memory snapshots, and deterministic synthetic generators.
//!
//! A [`Trace`] is a list of [`Event`]s: allocations named by an id chosen by the trace, and
//! frees of those ids. Every reader checks the trace as it goes (no free of an unknown id, no
//! second allocation under a live id, no size of 0 or above [`MAX_BYTES`]) and reports the
//! first problem as a [`TraceError`] naming the line (text) or event index (PyTorch); none of
//! them panics on bad input.
//!
//! ```
//! use stitch_alloc::trace::{Event, Trace};
//! let t = Trace::parse_str("# two tensors\na 1 4096\na 2 1048576 7\nf 1\nf 2 1048576 7\n").unwrap();
//! assert_eq!(t.events[1], Event::Alloc { id: 2, bytes: 1 << 20, stream: 7 });
//! assert_eq!(t.events[3], Event::Free { id: 2, stream: Some(7) });
//! assert_eq!(t.to_text(), "a 1 4096\na 2 1048576 7\nf 1\nf 2 1048576 7\n");
//! ```
#![forbid(unsafe_code)]

pub mod gen;
mod pickle;
pub mod pytorch;
mod text;

use rustc_hash::FxHashMap;
use std::io::{Read, Write};
use std::path::Path;

pub use text::{parse_reader, write_text};

/// The largest allocation a trace may ask for: 1 PiB. Anything larger is taken for a
/// corrupt trace.
pub const MAX_BYTES: u64 = 1 << 50;

/// One step of a trace.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Event {
    /// Allocate `bytes` on `stream`; later events refer to the allocation by `id`.
    Alloc {
        /// The trace's name for the allocation, unique among live allocations.
        id: u64,
        /// Bytes requested (1 ..= [`MAX_BYTES`]).
        bytes: u64,
        /// The stream (0 = the default stream).
        stream: u64,
    },
    /// Free the live allocation `id`, on `stream` (the allocating stream when `None`).
    Free {
        /// The allocation.
        id: u64,
        /// The stream of its last use, if the trace says.
        stream: Option<u64>,
    },
    /// Measure the largest single allocation that still succeeds at this point (by search,
    /// without changing what is live). Written as the comment line `# probe-largest`, so
    /// other tools reading the text format skip it.
    ProbeLargest,
}

/// A sequence of allocation events.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    /// The events, in order.
    pub events: Vec<Event>,
}

/// Why a trace could not be read. Text-format errors name the 1-based line; PyTorch
/// snapshot errors name the 0-based index of the entry in the device's trace.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// An I/O error, or bytes that are not UTF-8 text.
    #[error("line {line}: cannot read: {source}")]
    Io {
        /// The line being read.
        line: usize,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The gzip stream ended early or is corrupt.
    #[error("line {line}: gzip stream is truncated or corrupt: {message}")]
    Gzip {
        /// The line being read when the stream broke.
        line: usize,
        /// The decompressor's message.
        message: String,
    },
    /// The first word of a line is not `a` or `f`.
    #[error("line {line}: unknown action {action:?} (expected `a` or `f`)")]
    UnknownAction {
        /// The line.
        line: usize,
        /// What was found.
        action: String,
    },
    /// A field that should be an unsigned integer is not.
    #[error("line {line}: {field} {text:?} is not an unsigned integer")]
    BadNumber {
        /// The line.
        line: usize,
        /// Which field (`id`, `bytes`, `stream`).
        field: &'static str,
        /// What was found.
        text: String,
    },
    /// A required field is missing.
    #[error("line {line}: missing {field}")]
    MissingField {
        /// The line.
        line: usize,
        /// Which field.
        field: &'static str,
    },
    /// More fields than the action takes.
    #[error("line {line}: unexpected extra field {text:?}")]
    ExtraField {
        /// The line.
        line: usize,
        /// The first extra field.
        text: String,
    },
    /// A free of an id that is not live.
    #[error("line {line}: free of unknown id {id} (never allocated, or already freed)")]
    UnknownId {
        /// The line.
        line: usize,
        /// The id.
        id: u64,
    },
    /// An allocation under an id that is still live.
    #[error("line {line}: id {id} is allocated again while still live")]
    DuplicateId {
        /// The line.
        line: usize,
        /// The id.
        id: u64,
    },
    /// A size of zero or above [`MAX_BYTES`].
    #[error("line {line}: absurd size {bytes} (must be 1 ..= 2^50 bytes)")]
    AbsurdSize {
        /// The line.
        line: usize,
        /// The size found.
        bytes: u64,
    },
    /// A free names a size different from its allocation's.
    #[error(
        "line {line}: free of id {id} says {found} bytes but it was allocated with {expected}"
    )]
    SizeMismatch {
        /// The line.
        line: usize,
        /// The id.
        id: u64,
        /// Bytes at allocation.
        expected: u64,
        /// Bytes on the free line.
        found: u64,
    },
    /// A PyTorch snapshot that could not be unpickled or lacks the expected structure.
    #[error("PyTorch snapshot: {0}")]
    Snapshot(String),
    /// A PyTorch snapshot entry that cannot be used.
    #[error("PyTorch snapshot, device {device}, event {index}: {message}")]
    SnapshotEvent {
        /// The device's index in `device_traces`.
        device: usize,
        /// The entry's index in that device's trace.
        index: usize,
        /// What is wrong with it.
        message: String,
    },
}

/// Which reader to use for a file.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Format {
    /// Decide from the content: a pickle (first byte 0x80, after gunzip) is a PyTorch
    /// snapshot, anything else the text format.
    #[default]
    Auto,
    /// The text format.
    Text,
    /// A PyTorch snapshot pickle.
    PyTorch,
}

/// Options for [`read_path`] and [`read_bytes`].
#[derive(Copy, Clone, Debug, Default)]
pub struct ReadOptions {
    /// The format (default: detect).
    pub format: Format,
    /// For PyTorch snapshots: which device's trace (default: the first non-empty one).
    pub device: Option<usize>,
}

/// Whether `bytes` start with the gzip magic number.
pub fn is_gzip(bytes: &[u8]) -> bool {
    bytes.len() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b
}

/// Read a trace file of any supported format, gzipped or not (decided by the magic bytes,
/// whatever the extension).
pub fn read_path(path: impl AsRef<Path>, opts: ReadOptions) -> Result<Trace, TraceError> {
    let bytes =
        std::fs::read(path.as_ref()).map_err(|source| TraceError::Io { line: 0, source })?;
    read_bytes(&bytes, opts)
}

/// Read a trace from memory (see [`read_path`]).
pub fn read_bytes(bytes: &[u8], opts: ReadOptions) -> Result<Trace, TraceError> {
    let gz = is_gzip(bytes);
    let format = match opts.format {
        Format::Auto => {
            let first = if gz {
                let mut d = flate2::read::MultiGzDecoder::new(bytes);
                let mut b = [0u8; 1];
                match d.read(&mut b) {
                    Ok(1) => Some(b[0]),
                    _ => None,
                }
            } else {
                bytes.first().copied()
            };
            if first == Some(0x80) {
                Format::PyTorch
            } else {
                Format::Text
            }
        }
        f => f,
    };
    match format {
        Format::PyTorch => {
            // Decoded as it is decompressed: the plain pickle is never held in memory.
            if gz {
                pytorch::parse_snapshot_reader(
                    flate2::read::MultiGzDecoder::new(bytes),
                    opts.device,
                )
            } else {
                pytorch::parse_snapshot(bytes, opts.device)
            }
        }
        _ => {
            if gz {
                parse_reader(
                    std::io::BufReader::new(flate2::read::MultiGzDecoder::new(bytes)),
                    true,
                )
            } else {
                parse_reader(bytes, false)
            }
        }
    }
}

impl Trace {
    /// Parse the text format from a string.
    pub fn parse_str(s: &str) -> Result<Trace, TraceError> {
        parse_reader(s.as_bytes(), false)
    }

    /// The text format, as a string.
    pub fn to_text(&self) -> String {
        let mut v = Vec::new();
        write_text(self, &mut v).expect("writing to a Vec cannot fail");
        String::from_utf8(v).expect("the text format is ASCII")
    }

    /// Write the text format to `path`, gzipped when the name ends in `.gz`.
    pub fn write_path(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        let path = path.as_ref();
        let f = std::io::BufWriter::new(std::fs::File::create(path)?);
        if path.extension().is_some_and(|e| e == "gz") {
            let mut gz = flate2::write::GzEncoder::new(f, flate2::Compression::new(6));
            write_text(self, &mut gz)?;
            gz.finish()?.flush()
        } else {
            let mut f = f;
            write_text(self, &mut f)?;
            f.flush()
        }
    }

    /// Number of allocation and free events (probes not counted).
    pub fn op_count(&self) -> usize {
        self.events
            .iter()
            .filter(|e| !matches!(e, Event::ProbeLargest))
            .count()
    }

    /// Check the trace's rules (as the readers do); `Err` names the 0-based event index as
    /// the `line`.
    pub fn validate(&self) -> Result<(), TraceError> {
        let mut live: FxHashMap<u64, u64> = FxHashMap::default();
        for (i, e) in self.events.iter().enumerate() {
            match *e {
                Event::Alloc { id, bytes, .. } => {
                    if bytes == 0 || bytes > MAX_BYTES {
                        return Err(TraceError::AbsurdSize { line: i, bytes });
                    }
                    if live.insert(id, bytes).is_some() {
                        return Err(TraceError::DuplicateId { line: i, id });
                    }
                }
                Event::Free { id, .. } => {
                    if live.remove(&id).is_none() {
                        return Err(TraceError::UnknownId { line: i, id });
                    }
                }
                Event::ProbeLargest => {}
            }
        }
        Ok(())
    }

    /// Summary figures computed from the trace alone (no allocator).
    pub fn summary(&self) -> TraceSummary {
        let mut live: FxHashMap<u64, u64> = FxHashMap::default();
        let mut s = TraceSummary::default();
        let mut cur = 0u64;
        let mut streams = std::collections::BTreeSet::new();
        for e in &self.events {
            match *e {
                Event::Alloc { id, bytes, stream } => {
                    s.allocs += 1;
                    s.total_alloc_bytes += bytes;
                    if bytes < 1 << 20 {
                        s.small_allocs += 1;
                    }
                    s.largest_alloc = s.largest_alloc.max(bytes);
                    live.insert(id, bytes);
                    cur += bytes;
                    s.peak_live_bytes = s.peak_live_bytes.max(cur);
                    streams.insert(stream);
                }
                Event::Free { id, stream } => {
                    s.frees += 1;
                    cur -= live.remove(&id).unwrap_or(0);
                    if let Some(st) = stream {
                        streams.insert(st);
                    }
                }
                Event::ProbeLargest => s.probes += 1,
            }
        }
        s.final_live_bytes = cur;
        s.streams = streams.len() as u64;
        s
    }
}

/// Figures about a trace computed without an allocator.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TraceSummary {
    /// Allocation events.
    pub allocs: u64,
    /// Free events.
    pub frees: u64,
    /// Probe markers.
    pub probes: u64,
    /// Allocations under 1 MiB.
    pub small_allocs: u64,
    /// The largest allocation.
    pub largest_alloc: u64,
    /// Sum of all allocation sizes.
    pub total_alloc_bytes: u64,
    /// The most bytes live at once.
    pub peak_live_bytes: u64,
    /// Bytes still live at the end.
    pub final_live_bytes: u64,
    /// Distinct streams.
    pub streams: u64,
}
