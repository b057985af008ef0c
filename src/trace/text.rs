//! The plain text trace format.
//!
//! One event a line, fields separated by spaces or tabs:
//!
//! ```text
//! # comment lines start with '#'; blank lines are ignored
//! a <id> <bytes> [stream]     allocate <bytes> under <id> (on <stream>, default 0)
//! f <id> [bytes] [stream]     free <id> (bytes, if given, must match the allocation)
//! # probe-largest             measure the largest allocation that still succeeds here
//! ```
//!
//! Numbers are unsigned decimal integers. Ids are arbitrary but unique among live
//! allocations. A free without a stream is taken to happen on the allocating stream.

use super::{Event, Trace, TraceError, MAX_BYTES};
use rustc_hash::FxHashMap;
use std::io::{BufRead, Write};

/// The comment line that stands for [`Event::ProbeLargest`].
pub(crate) const PROBE_LINE: &str = "# probe-largest";

fn num(line: usize, field: &'static str, tok: Option<&[u8]>) -> Result<u64, TraceError> {
    let tok = tok.ok_or(TraceError::MissingField { line, field })?;
    let bad = || TraceError::BadNumber {
        line,
        field,
        text: String::from_utf8_lossy(tok).into_owned(),
    };
    if tok.is_empty() || tok.len() > 20 || !tok.iter().all(u8::is_ascii_digit) {
        return Err(bad());
    }
    // At most 20 ASCII digits: parse with overflow checks.
    let mut v: u64 = 0;
    for &c in tok {
        v = v
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(c - b'0')))
            .ok_or_else(bad)?;
    }
    Ok(v)
}

fn opt_num(
    line: usize,
    field: &'static str,
    tok: Option<&[u8]>,
) -> Result<Option<u64>, TraceError> {
    match tok {
        None => Ok(None),
        t => num(line, field, t).map(Some),
    }
}

fn is_ws(c: &u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\r' | b'\n' | b'\x0b' | b'\x0c')
}

/// Parse the text format from a buffered reader. `gzip` says whether the bytes come out of a
/// gzip decoder (read errors are then reported as truncated or corrupt gzip).
pub fn parse_reader<R: BufRead>(mut r: R, gzip: bool) -> Result<Trace, TraceError> {
    let mut events = Vec::new();
    let mut live: FxHashMap<u64, u64> = FxHashMap::default();
    let mut buf = Vec::with_capacity(64);
    let mut line = 0usize;
    loop {
        buf.clear();
        line += 1;
        match r.read_until(b'\n', &mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if gzip => {
                return Err(TraceError::Gzip {
                    line,
                    message: e.to_string(),
                })
            }
            Err(source) => return Err(TraceError::Io { line, source }),
        }
        let mut toks = buf.split(is_ws).filter(|t| !t.is_empty());
        let Some(action) = toks.next() else { continue };
        if action[0] == b'#' {
            let text = String::from_utf8_lossy(&buf);
            if text.trim() == PROBE_LINE {
                events.push(Event::ProbeLargest);
            }
            continue;
        }
        let ev = match action {
            b"a" => {
                let id = num(line, "id", toks.next())?;
                let bytes = num(line, "bytes", toks.next())?;
                let stream = opt_num(line, "stream", toks.next())?.unwrap_or(0);
                if bytes == 0 || bytes > MAX_BYTES {
                    return Err(TraceError::AbsurdSize { line, bytes });
                }
                if live.insert(id, bytes).is_some() {
                    return Err(TraceError::DuplicateId { line, id });
                }
                Event::Alloc { id, bytes, stream }
            }
            b"f" => {
                let id = num(line, "id", toks.next())?;
                let bytes = opt_num(line, "bytes", toks.next())?;
                let stream = opt_num(line, "stream", toks.next())?;
                let Some(expected) = live.remove(&id) else {
                    return Err(TraceError::UnknownId { line, id });
                };
                if let Some(found) = bytes {
                    if found != expected {
                        return Err(TraceError::SizeMismatch {
                            line,
                            id,
                            expected,
                            found,
                        });
                    }
                }
                Event::Free { id, stream }
            }
            other => {
                return Err(TraceError::UnknownAction {
                    line,
                    action: String::from_utf8_lossy(other).into_owned(),
                })
            }
        };
        if let Some(extra) = toks.next() {
            return Err(TraceError::ExtraField {
                line,
                text: String::from_utf8_lossy(extra).into_owned(),
            });
        }
        events.push(ev);
    }
    Ok(Trace { events })
}

/// Write `trace` in the text format. Allocations on stream 0 omit the stream; frees write
/// `f <id>` when they carry no stream, else `f <id> <bytes> <stream>`.
pub fn write_text<W: Write>(trace: &Trace, w: &mut W) -> std::io::Result<()> {
    let mut live: FxHashMap<u64, u64> = FxHashMap::default();
    for e in &trace.events {
        match *e {
            Event::Alloc { id, bytes, stream } => {
                live.insert(id, bytes);
                if stream == 0 {
                    writeln!(w, "a {id} {bytes}")?;
                } else {
                    writeln!(w, "a {id} {bytes} {stream}")?;
                }
            }
            Event::Free { id, stream } => {
                let bytes = live.remove(&id);
                match (stream, bytes) {
                    (Some(s), Some(b)) => writeln!(w, "f {id} {b} {s}")?,
                    _ => writeln!(w, "f {id}")?,
                }
            }
            Event::ProbeLargest => writeln!(w, "{PROBE_LINE}")?,
        }
    }
    Ok(())
}
