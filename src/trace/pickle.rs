//! A streaming decoder for the pickles that hold PyTorch memory snapshots.
//!
//! A snapshot written by `torch.cuda.memory._dump_snapshot()` (Python's `pickle.dump` of
//! `_snapshot()`) is mostly bytes the replay does not need: stack traces (`frames`), blocks,
//! annotations. Building a generic value tree of all of it took about 26 times the file's
//! size in memory. This decoder reads the opcode stream once, from any [`Read`], and keeps
//! only what [`super::pytorch`] reads:
//!
//! * a dict keeps the values of the keys in [`Atom::is_key`] (`device_traces`, `segments`,
//!   `allocator_settings`, `action`, `addr`, `size`, `stream`, `device`, `total_size`,
//!   `expandable_segments`) and drops every other value as soon as it is set;
//! * a list keeps its items; a list of trace entries (dicts whose keys are among `action`,
//!   `addr`, `size`, `stream`, with scalar values) keeps each as a 32-byte [`Entry`];
//! * strings are kept only as which known string ([`Atom`]) they are, if any;
//! * the memo keeps scalars (and which known string). A second reference to a container
//!   (memo get, `DUP`) reads as [`V::Shared`]: torch shares frame lists and frame dicts this
//!   way, and nothing needed is ever shared, so the container itself is not kept.
//!
//! Hostile input: memory is bounded by a budget of live values (stack, kept items, memo) of
//! [`BASE_LIVE`] plus one per [`BYTES_PER_LIVE`] bytes read, checked as they are added;
//! containers nest at most [`MAX_DEPTH`] deep; lengths are never allocated, only skipped;
//! every malformed input is an error naming the byte offset, never a panic. Nothing copies a
//! value at a reference, so reference bombs cost nothing.
#![forbid(unsafe_code)]

use rustc_hash::FxHashMap;
use std::io::Read;

/// Live values allowed whatever the input's size.
pub(crate) const BASE_LIVE: u64 = 1 << 20;
/// One more live value allowed per this many bytes read. Real snapshots keep about one per
/// 20 bytes (serve: 7.7 M for 181 MB, frames off); frames make it far fewer.
pub(crate) const BYTES_PER_LIVE: u64 = 8;
/// Containers nest at most this deep in what is kept (a snapshot needs 4).
pub(crate) const MAX_DEPTH: u8 = 32;
/// Strings and bytes longer than this are skipped unread (no known string is this long).
const MAX_ATOM_LEN: usize = 32;
const BUF: usize = 1 << 18;

/// The strings the snapshot reader recognises: the keys it keeps and the action names.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub(crate) enum Atom {
    DeviceTraces,
    Segments,
    AllocatorSettings,
    Action,
    Addr,
    Size,
    Stream,
    Device,
    TotalSize,
    ExpandableSegments,
    Alloc,
    FreeRequested,
    FreeCompleted,
    Free,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
}

const ATOMS: [(&str, Atom); 18] = [
    ("device_traces", Atom::DeviceTraces),
    ("segments", Atom::Segments),
    ("allocator_settings", Atom::AllocatorSettings),
    ("action", Atom::Action),
    ("addr", Atom::Addr),
    ("size", Atom::Size),
    ("stream", Atom::Stream),
    ("device", Atom::Device),
    ("total_size", Atom::TotalSize),
    ("expandable_segments", Atom::ExpandableSegments),
    ("alloc", Atom::Alloc),
    ("free_requested", Atom::FreeRequested),
    ("free_completed", Atom::FreeCompleted),
    ("free", Atom::Free),
    ("segment_alloc", Atom::SegmentAlloc),
    ("segment_free", Atom::SegmentFree),
    ("segment_map", Atom::SegmentMap),
    ("segment_unmap", Atom::SegmentUnmap),
];

impl Atom {
    fn find(b: &[u8]) -> Option<Atom> {
        ATOMS
            .iter()
            .find(|(s, _)| s.as_bytes() == b)
            .map(|&(_, a)| a)
    }

    /// The string itself.
    pub(crate) fn name(self) -> &'static str {
        ATOMS[self as usize].0
    }

    /// Whether a dict keeps its value under this key.
    fn is_key(self) -> bool {
        (self as usize) < 10
    }

    /// The position of an entry field in [`Entry`].
    fn entry_field(self) -> Option<usize> {
        match self {
            Atom::Addr => Some(0),
            Atom::Size => Some(1),
            Atom::Stream => Some(2),
            _ => None,
        }
    }
}

/// A decoded value, pruned to what the snapshot reader uses.
#[derive(Debug)]
pub(crate) enum V {
    None,
    Bool(bool),
    Int(i64),
    /// An integer above `i64::MAX` that fits a `u64`.
    UInt(u64),
    /// An integer outside `i64::MIN ..= u64::MAX`.
    BigInt,
    Float(f64),
    /// A string (or UTF-8 bytes), and which known string it is.
    Str(Option<Atom>),
    /// Bytes that are not UTF-8.
    Bytes,
    Dict(Box<Dict>),
    /// A list or a tuple.
    List(Box<List>),
    /// A second reference to a container, which is not kept.
    Shared,
    /// Anything else: objects, globals, sets, buffers.
    Other,
}

/// A scalar view of a value (containers only say that they are one).
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) enum S {
    None,
    Bool(bool),
    Int(i64),
    UInt(u64),
    BigInt,
    Float(f64),
    Str(Option<Atom>),
    Bytes,
    Container,
    Other,
}

impl std::fmt::Display for S {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            S::None => write!(f, "None"),
            S::Bool(b) => write!(f, "{}", if *b { "True" } else { "False" }),
            S::Int(i) => write!(f, "{i}"),
            S::UInt(u) => write!(f, "{u}"),
            S::BigInt => write!(f, "an integer beyond 64 bits"),
            S::Float(x) => write!(f, "{x:?}"),
            S::Str(Some(a)) => write!(f, "{:?}", a.name()),
            S::Str(None) => write!(f, "a string"),
            S::Bytes => write!(f, "bytes"),
            S::Container => write!(f, "a container"),
            S::Other => write!(f, "an object"),
        }
    }
}

impl S {
    /// The value as a `u64`: non-negative integers and booleans.
    pub(crate) fn as_u64(self) -> Option<u64> {
        match self {
            S::Int(i) => u64::try_from(i).ok(),
            S::UInt(u) => Some(u),
            S::Bool(b) => Some(u64::from(b)),
            _ => None,
        }
    }
}

impl V {
    pub(crate) fn scalar(&self) -> S {
        match *self {
            V::None => S::None,
            V::Bool(b) => S::Bool(b),
            V::Int(i) => S::Int(i),
            V::UInt(u) => S::UInt(u),
            V::BigInt => S::BigInt,
            V::Float(x) => S::Float(x),
            V::Str(a) => S::Str(a),
            V::Bytes => S::Bytes,
            V::Dict(_) | V::List(_) | V::Shared => S::Container,
            V::Other => S::Other,
        }
    }

    fn from_scalar(s: S) -> V {
        match s {
            S::None => V::None,
            S::Bool(b) => V::Bool(b),
            S::Int(i) => V::Int(i),
            S::UInt(u) => V::UInt(u),
            S::BigInt => V::BigInt,
            S::Float(x) => V::Float(x),
            S::Str(a) => V::Str(a),
            S::Bytes => V::Bytes,
            S::Container => V::Shared,
            S::Other => V::Other,
        }
    }

    /// Live values this one counts for (see the module's budget).
    fn weight(&self) -> u64 {
        match self {
            V::Dict(d) => d.weight,
            V::List(l) => l.weight,
            _ => 1,
        }
    }

    fn depth(&self) -> u8 {
        match self {
            V::Dict(d) => d.depth,
            V::List(l) => l.depth,
            _ => 0,
        }
    }

    pub(crate) fn as_dict(&self) -> Option<&Dict> {
        match self {
            V::Dict(d) => Some(d),
            _ => None,
        }
    }

    pub(crate) fn as_list(&self) -> Option<&List> {
        match self {
            V::List(l) => Some(l),
            _ => None,
        }
    }
}

/// A dict's kept fields (known keys only), in the order first set.
#[derive(Debug)]
pub(crate) struct Dict {
    fields: Vec<(Atom, V)>,
    weight: u64,
    depth: u8,
}

impl Dict {
    fn new() -> Dict {
        Dict {
            fields: Vec::new(),
            weight: 1,
            depth: 1,
        }
    }

    pub(crate) fn get(&self, key: Atom) -> Option<&V> {
        self.fields.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// The dict as a trace entry, if that loses nothing: only `action`, `addr`, `size`,
    /// `stream` keys, `action` among them, and scalar values.
    fn as_entry(&self) -> Option<Entry> {
        self.get(Atom::Action)?;
        let mut e = Entry::EMPTY;
        for (k, v) in &self.fields {
            if matches!(v, V::Dict(_) | V::List(_)) {
                return None;
            }
            match (*k, k.entry_field()) {
                (Atom::Action, _) => e.action = v.scalar(),
                (_, Some(i)) => e.set(i, v.scalar()),
                _ => return None,
            }
        }
        Some(e)
    }

    fn from_entry(e: &Entry) -> Dict {
        let mut d = Dict::new();
        if e.has_action() {
            d.fields.push((Atom::Action, V::from_scalar(e.action)));
        }
        for (i, key) in [Atom::Addr, Atom::Size, Atom::Stream]
            .into_iter()
            .enumerate()
        {
            if let Some(s) = e.field(i) {
                d.fields.push((key, V::from_scalar(s)));
            }
        }
        d.weight = 1 + d.fields.len() as u64;
        d
    }
}

/// How an [`Entry`] field was given.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum K {
    Absent,
    /// A non-negative integer (or a boolean, kept as `Bool`), in `vals`.
    U,
    Neg,
    Bool,
    Float,
    Str,
    Other,
}

/// A trace entry, compact: `action` and the three integer fields.
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) struct Entry {
    /// The `action` value.
    pub(crate) action: S,
    vals: [u64; 3],
    /// Kinds of `vals`; `kinds[3]` is `Absent` when `action` is missing.
    kinds: [K; 4],
    /// For `K::Other`: the scalar's view (None, big integer, bytes, ...).
    others: [u8; 3],
}

impl Entry {
    const EMPTY: Entry = Entry {
        action: S::Other,
        vals: [0; 3],
        kinds: [K::Absent, K::Absent, K::Absent, K::U],
        others: [0; 3],
    };

    fn set(&mut self, i: usize, s: S) {
        let (k, v, o) = match s {
            S::Int(x) if x >= 0 => (K::U, x as u64, 0),
            S::Int(x) => (K::Neg, x as u64, 0),
            S::UInt(x) => (K::U, x, 0),
            S::Bool(b) => (K::Bool, u64::from(b), 0),
            S::Float(x) => (K::Float, x.to_bits(), 0),
            S::Str(a) => (K::Str, a.map_or(u64::MAX, |a| a as u64), 0),
            S::None => (K::Other, 0, 0),
            S::BigInt => (K::Other, 0, 1),
            S::Bytes => (K::Other, 0, 2),
            S::Container => (K::Other, 0, 3),
            S::Other => (K::Other, 0, 4),
        };
        self.kinds[i] = k;
        self.vals[i] = v;
        self.others[i] = o;
    }

    /// Field `i` (0 `addr`, 1 `size`, 2 `stream`), `None` when absent.
    pub(crate) fn field(&self, i: usize) -> Option<S> {
        let v = self.vals[i];
        Some(match self.kinds[i] {
            K::Absent => return None,
            K::U if v > i64::MAX as u64 => S::UInt(v),
            K::U | K::Neg => S::Int(v as i64),
            K::Bool => S::Bool(v != 0),
            K::Float => S::Float(f64::from_bits(v)),
            K::Str => S::Str(ATOMS.get(v as usize).map(|&(_, a)| a)),
            K::Other => match self.others[i] {
                0 => S::None,
                1 => S::BigInt,
                2 => S::Bytes,
                3 => S::Container,
                _ => S::Other,
            },
        })
    }

    /// The field under `key`, as a dict would give it.
    pub(crate) fn get(&self, key: Atom) -> Option<S> {
        match key {
            Atom::Action => self.has_action().then_some(self.action),
            k => k.entry_field().and_then(|i| self.field(i)),
        }
    }
}

#[derive(Debug)]
enum Items {
    /// Every item so far is a trace entry.
    Entries(Vec<Entry>),
    /// Every item so far is a scalar or a second reference (frame lists): only counted.
    Scalars(usize),
    Values(Vec<V>),
}

/// A list's (or tuple's) items.
#[derive(Debug)]
pub(crate) struct List {
    items: Items,
    weight: u64,
    depth: u8,
}

/// One item of a [`List`]: a trace entry, or any value.
pub(crate) enum Item<'a> {
    Entry(Entry),
    V(&'a V),
}

impl Item<'_> {
    /// A field of a dict item (`None` when absent); `Err` when the item is not a dict.
    pub(crate) fn get(&self, key: Atom) -> Result<Option<S>, ()> {
        match self {
            Item::Entry(e) => Ok(e.get(key)),
            Item::V(V::Dict(d)) => Ok(d.get(key).map(V::scalar)),
            Item::V(_) => Err(()),
        }
    }

    /// The item as a trace entry, `None` when it is not a dict.
    pub(crate) fn entry(&self) -> Option<Entry> {
        match self {
            Item::Entry(e) => Some(*e),
            Item::V(V::Dict(d)) => {
                let mut e = Entry::EMPTY;
                match d.get(Atom::Action) {
                    Some(a) => e.action = a.scalar(),
                    None => e.kinds[3] = K::Absent,
                }
                for (i, key) in [Atom::Addr, Atom::Size, Atom::Stream]
                    .into_iter()
                    .enumerate()
                {
                    if let Some(v) = d.get(key) {
                        e.set(i, v.scalar());
                    }
                }
                Some(e)
            }
            Item::V(_) => None,
        }
    }
}

impl<'a> Item<'a> {
    /// The item as a list, `None` when it is not one.
    pub(crate) fn as_list(&self) -> Option<&'a List> {
        match *self {
            Item::V(v) => v.as_list(),
            Item::Entry(_) => None,
        }
    }
}

impl Entry {
    /// Whether the entry has an `action` at all.
    pub(crate) fn has_action(&self) -> bool {
        self.kinds[3] != K::Absent
    }
}

impl List {
    fn new() -> List {
        List {
            items: Items::Entries(Vec::new()),
            weight: 1,
            depth: 1,
        }
    }

    pub(crate) fn len(&self) -> usize {
        match &self.items {
            Items::Entries(e) => e.len(),
            Items::Scalars(n) => *n,
            Items::Values(v) => v.len(),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn item(&self, i: usize) -> Item<'_> {
        match &self.items {
            Items::Entries(e) => Item::Entry(e[i]),
            Items::Scalars(_) => Item::V(&V::Other),
            Items::Values(v) => Item::V(&v[i]),
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = Item<'_>> {
        (0..self.len()).map(|i| self.item(i))
    }

    /// Append `v`; the weight added (see the module's budget).
    fn push(&mut self, v: V) -> Result<u64, String> {
        let depth = v.depth();
        if depth >= MAX_DEPTH {
            return Err(format!("containers nested more than {MAX_DEPTH} deep"));
        }
        self.depth = self.depth.max(depth + 1);
        let container = matches!(v, V::Dict(_) | V::List(_));
        match &mut self.items {
            Items::Entries(es) => {
                if let Some(e) = v.as_dict().and_then(Dict::as_entry) {
                    es.push(e);
                    self.weight += 1;
                    return Ok(1);
                }
                if es.is_empty() && !container {
                    self.items = Items::Scalars(1);
                    self.weight += 1;
                    return Ok(1);
                }
            }
            Items::Scalars(n) if !container => {
                *n += 1;
                self.weight += 1;
                return Ok(1);
            }
            Items::Scalars(_) => {}
            Items::Values(vs) => {
                let w = v.weight();
                vs.push(v);
                self.weight += w;
                return Ok(w);
            }
        }
        // A value that does not fit the compact form: keep every item as a value from now
        // on (scalars only counted become opaque values).
        let vals: Vec<V> = match std::mem::replace(&mut self.items, Items::Scalars(0)) {
            Items::Entries(es) => es
                .iter()
                .map(|e| V::Dict(Box::new(Dict::from_entry(e))))
                .collect(),
            Items::Scalars(n) => std::iter::repeat_with(|| V::Other).take(n).collect(),
            Items::Values(vs) => vs,
        };
        let added: u64 = vals.iter().map(|v| v.weight() - 1).sum();
        let w = v.weight();
        let mut vals = vals;
        vals.push(v);
        self.items = Items::Values(vals);
        self.weight += added + w;
        Ok(added + w)
    }
}

/// A memo entry: scalars are kept (big numbers in `Decoder::memo_nums`), containers are not.
#[derive(Copy, Clone, Debug)]
enum M {
    Unset,
    None,
    Bool(bool),
    Str(Option<Atom>),
    Bytes,
    Container,
    Other,
    BigInt,
    Num(u32),
}

/// Why a pickle could not be decoded.
#[derive(Debug)]
pub(crate) enum DecodeError {
    /// Reading the input failed (a corrupt gzip stream, an I/O error).
    Io(std::io::Error),
    /// The bytes are not a pickle this decoder accepts.
    Bad(String),
}

type R<T> = Result<T, DecodeError>;

fn bad<T>(msg: String) -> R<T> {
    Err(DecodeError::Bad(msg))
}

/// Buffered input with the offset of each byte, for error messages.
struct Input<Rd> {
    r: Rd,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
    /// Bytes consumed before `buf[0]`.
    base: u64,
}

impl<Rd: Read> Input<Rd> {
    fn offset(&self) -> u64 {
        self.base + self.pos as u64
    }

    /// Make at least `n` (≤ `BUF`) bytes available; `false` at the end of the input.
    fn fill(&mut self, n: usize) -> R<bool> {
        if self.end - self.pos >= n {
            return Ok(true);
        }
        self.buf.copy_within(self.pos..self.end, 0);
        self.base += self.pos as u64;
        self.end -= self.pos;
        self.pos = 0;
        while self.end < n {
            match self.r.read(&mut self.buf[self.end..]) {
                Ok(0) => return Ok(false),
                Ok(k) => self.end += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(DecodeError::Io(e)),
            }
        }
        Ok(true)
    }

    fn truncated<T>(&self) -> R<T> {
        bad(format!(
            "truncated pickle at byte {}",
            self.base + self.end as u64
        ))
    }

    #[inline]
    fn byte(&mut self) -> R<u8> {
        if self.pos == self.end && !self.fill(1)? {
            return self.truncated();
        }
        let b = self.buf[self.pos];
        self.pos += 1;
        Ok(b)
    }

    /// The next `n` (≤ `BUF`) bytes.
    fn take(&mut self, n: usize) -> R<&[u8]> {
        if !self.fill(n)? {
            return self.truncated();
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    /// A little-endian unsigned integer of `n` ≤ 8 bytes.
    fn uint(&mut self, n: usize) -> R<u64> {
        Ok(self
            .take(n)?
            .iter()
            .rev()
            .fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
    }

    fn skip(&mut self, mut n: u64) -> R<()> {
        while n > 0 {
            if self.pos == self.end && !self.fill(1)? {
                return self.truncated();
            }
            let k = n.min((self.end - self.pos) as u64);
            self.pos += k as usize;
            n -= k;
        }
        Ok(())
    }

    /// A text line (protocol 0 arguments), without its newline; only its first 64 bytes
    /// are kept in `out`.
    fn line(&mut self, out: &mut Vec<u8>) -> R<()> {
        out.clear();
        loop {
            let b = self.byte()?;
            if b == b'\n' {
                return Ok(());
            }
            if out.len() < 64 {
                out.push(b);
            }
        }
    }
}

/// The decoder's state.
struct Decoder<Rd> {
    inp: Input<Rd>,
    stack: Vec<V>,
    /// Stack lengths at each open mark.
    marks: Vec<usize>,
    memo: Vec<M>,
    /// Memo entries put at indices beyond the dense part.
    sparse: FxHashMap<u64, M>,
    memo_nums: Vec<V>,
    /// Live values: weights on the stack, marks, memo entries.
    live: u64,
    /// The budget for `live` last computed (it only grows).
    limit: u64,
    scratch: Vec<V>,
    line: Vec<u8>,
}

/// Decode the pickle read from `r` into the pruned value (see the module documentation).
pub(crate) fn decode(r: impl Read) -> Result<V, DecodeError> {
    let mut d = Decoder {
        inp: Input {
            r,
            buf: vec![0u8; BUF].into_boxed_slice(),
            pos: 0,
            end: 0,
            base: 0,
        },
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Vec::new(),
        sparse: FxHashMap::default(),
        memo_nums: Vec::new(),
        live: 0,
        limit: BASE_LIVE,
        scratch: Vec::new(),
        line: Vec::new(),
    };
    d.run()
}

fn int_from_le(b: &[u8]) -> V {
    if b.is_empty() {
        return V::Int(0);
    }
    let neg = b[b.len() - 1] & 0x80 != 0;
    // Drop redundant sign bytes, then see whether it fits 64 bits.
    let pad = if neg { 0xff } else { 0 };
    let mut n = b.len();
    while n > 1 && b[n - 1] == pad && (b[n - 2] & 0x80 != 0) == neg {
        n -= 1;
    }
    if n > 8 {
        if !neg && n == 9 && b[8] == 0 {
            let u = b[..8]
                .iter()
                .rev()
                .fold(0u64, |a, &x| (a << 8) | u64::from(x));
            return V::UInt(u);
        }
        return V::BigInt;
    }
    let mut u = b[..n]
        .iter()
        .rev()
        .fold(0u64, |a, &x| (a << 8) | u64::from(x));
    if neg && n < 8 {
        u |= !0u64 << (8 * n);
    }
    // After the stripping, the top byte's sign bit is the number's: it fits an i64.
    V::Int(u as i64)
}

fn int_from_text(s: &[u8]) -> V {
    let s = std::str::from_utf8(s).unwrap_or("").trim();
    let s = s.strip_suffix('L').unwrap_or(s);
    if let Ok(i) = s.parse::<i64>() {
        V::Int(i)
    } else if let Ok(u) = s.parse::<u64>() {
        V::UInt(u)
    } else if !s.is_empty()
        && s.trim_start_matches('-')
            .bytes()
            .all(|c| c.is_ascii_digit())
    {
        V::BigInt
    } else {
        V::Other
    }
}

fn str_value(b: &[u8]) -> V {
    match Atom::find(b) {
        Some(a) => V::Str(Some(a)),
        None if std::str::from_utf8(b).is_ok() => V::Str(None),
        None => V::Bytes,
    }
}

/// Set key/value `pairs` into `target` (a dict keeps its known keys; an object or a shared
/// container keeps nothing). Returns the weights taken from the stack and kept.
fn set_into(target: &mut V, pairs: impl Iterator<Item = V>, at: u64) -> R<(u64, u64)> {
    let d = match target {
        V::Dict(d) => d,
        // Items of an object (a dict subclass) or a shared container: not kept.
        V::Other | V::Shared => return Ok((pairs.map(|v| v.weight()).sum(), 0)),
        _ => {
            return bad(format!(
                "malformed pickle: items set on a non-dict at byte {at}"
            ))
        }
    };
    let (mut removed, mut kept) = (0u64, 0u64);
    let mut key = None;
    for v in pairs {
        removed += v.weight();
        let Some(k) = key.take() else {
            key = Some(v);
            continue;
        };
        let V::Str(Some(k)) = k else { continue };
        if !k.is_key() {
            continue;
        }
        let depth = v.depth();
        if depth >= MAX_DEPTH {
            return bad(format!(
                "containers nested more than {MAX_DEPTH} deep at byte {at}"
            ));
        }
        d.depth = d.depth.max(depth + 1);
        let w = v.weight();
        if let Some(slot) = d.fields.iter_mut().find(|(f, _)| *f == k) {
            let old = std::mem::replace(&mut slot.1, v);
            d.weight -= old.weight();
            kept = kept.wrapping_sub(old.weight());
        } else {
            d.fields.push((k, v));
        }
        d.weight += w;
        kept = kept.wrapping_add(w);
    }
    if key.is_some() {
        return bad(format!(
            "malformed pickle: odd number of dict items at byte {at}"
        ));
    }
    // `kept` may have wrapped below zero when lighter values replaced heavier ones.
    Ok((removed, kept))
}

/// Append `items` to `target` (a list keeps them; an object or a shared container keeps
/// nothing). Returns the weights taken from the stack and kept.
fn append_into(target: &mut V, items: impl Iterator<Item = V>, at: u64) -> R<(u64, u64)> {
    let l = match target {
        V::List(l) => l,
        V::Other | V::Shared => return Ok((items.map(|v| v.weight()).sum(), 0)),
        _ => {
            return bad(format!(
                "malformed pickle: append to a non-list at byte {at}"
            ))
        }
    };
    let (mut removed, mut kept) = (0u64, 0u64);
    for v in items {
        removed += v.weight();
        kept += l
            .push(v)
            .map_err(|m| DecodeError::Bad(format!("{m} at byte {at}")))?;
    }
    Ok((removed, kept))
}

impl<Rd: Read> Decoder<Rd> {
    fn err<T>(&self, what: &str) -> R<T> {
        bad(format!("{what} at byte {}", self.inp.offset()))
    }

    #[inline]
    fn budget(&mut self) -> R<()> {
        if self.live <= self.limit {
            return Ok(());
        }
        // The limit grows with the input read: recompute it only when it is reached.
        let limit = BASE_LIVE.saturating_add(self.inp.offset() / BYTES_PER_LIVE);
        self.limit = limit;
        if self.live > limit {
            return bad(format!(
                "the pickle keeps more than {limit} values after {} bytes (a snapshot needs \
                 about one per 20 bytes); refused",
                self.inp.offset()
            ));
        }
        Ok(())
    }

    fn push(&mut self, v: V) -> R<()> {
        self.live += v.weight();
        self.stack.push(v);
        self.budget()
    }

    fn pop(&mut self) -> R<V> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return self.err("malformed pickle: pops an empty stack (or past a mark)");
        }
        let v = self.stack.pop().expect("checked above");
        self.live -= v.weight();
        Ok(v)
    }

    /// Move the values above the topmost mark into `self.scratch` and drop the mark.
    fn pop_mark(&mut self) -> R<()> {
        let Some(m) = self.marks.pop() else {
            return self.err("malformed pickle: no mark to pop to");
        };
        self.live -= 1;
        self.scratch.clear();
        for v in self.stack.drain(m..) {
            self.live -= v.weight();
            self.scratch.push(v);
        }
        Ok(())
    }

    fn top_mut(&mut self) -> R<&mut V> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return self.err("malformed pickle: no object to add items to");
        }
        Ok(self.stack.last_mut().expect("checked above"))
    }

    /// Set `pairs` (key, value, key, value, ...) into the dict on top of the stack.
    fn set_items(&mut self, mut pairs: Vec<V>) -> R<()> {
        let at = self.inp.offset();
        // The items were taken off the stack (and out of `live`) already.
        let (_, kept) = set_into(self.top_mut()?, pairs.drain(..), at)?;
        self.scratch = pairs;
        self.live = self.live.wrapping_add(kept);
        self.budget()
    }

    /// Append `items` to the list on top of the stack.
    fn append_items(&mut self, mut items: Vec<V>) -> R<()> {
        let at = self.inp.offset();
        // The items were taken off the stack (and out of `live`) already.
        let (_, kept) = append_into(self.top_mut()?, items.drain(..), at)?;
        self.scratch = items;
        self.live = self.live.wrapping_add(kept);
        self.budget()
    }

    /// SETITEMS (`dict`) or APPENDS: the items above the topmost mark go, in place, into
    /// the container below it.
    fn batch(&mut self, dict: bool) -> R<()> {
        let Some(m) = self.marks.pop() else {
            return self.err("malformed pickle: no mark to pop to");
        };
        self.live -= 1;
        let floor = self.marks.last().copied().unwrap_or(0);
        if m <= floor {
            return self.err("malformed pickle: no object to add items to");
        }
        let at = self.inp.offset();
        let (lo, hi) = self.stack.split_at_mut(m);
        let target = &mut lo[m - 1];
        let items = hi.iter_mut().map(|v| std::mem::replace(v, V::None));
        let (removed, kept) = if dict {
            set_into(target, items, at)?
        } else {
            append_into(target, items, at)?
        };
        self.stack.truncate(m);
        self.live = (self.live - removed).wrapping_add(kept);
        self.budget()
    }

    fn memo_put(&mut self, idx: u64) -> R<()> {
        let floor = self.marks.last().copied().unwrap_or(0);
        let Some(top) = self.stack.last().filter(|_| self.stack.len() > floor) else {
            return self.err("malformed pickle: memo put of an empty stack");
        };
        let m = match top.scalar() {
            S::None => M::None,
            S::Bool(b) => M::Bool(b),
            S::Str(a) => M::Str(a),
            S::Bytes => M::Bytes,
            S::Container => M::Container,
            S::Other => M::Other,
            S::BigInt => M::BigInt,
            s @ (S::Int(_) | S::UInt(_) | S::Float(_)) => {
                let Ok(i) = u32::try_from(self.memo_nums.len()) else {
                    return self.err("too many memoized numbers");
                };
                self.memo_nums.push(V::from_scalar(s));
                self.live += 1;
                M::Num(i)
            }
        };
        let len = self.memo.len() as u64;
        if idx < len {
            self.memo[idx as usize] = m;
        } else if idx == len {
            self.memo.push(m);
            self.live += 1;
        } else if self.sparse.insert(idx, m).is_none() {
            self.live += 1;
        }
        self.budget()
    }

    fn memo_get(&mut self, idx: u64) -> R<()> {
        let m = if idx < self.memo.len() as u64 {
            self.memo[idx as usize]
        } else {
            self.sparse.get(&idx).copied().unwrap_or(M::Unset)
        };
        let v = match m {
            M::Unset => {
                return self.err(&format!("pickle refers to memo entry {idx}, never stored,"))
            }
            M::None => V::None,
            M::Bool(b) => V::Bool(b),
            M::Str(a) => V::Str(a),
            M::Bytes => V::Bytes,
            M::Container => V::Shared,
            M::Other => V::Other,
            M::BigInt => V::BigInt,
            M::Num(i) => V::from_scalar(self.memo_nums[i as usize].scalar()),
        };
        self.push(v)
    }

    /// A string or bytes argument of `len` bytes: which known string, if any.
    fn counted_str(&mut self, len: u64) -> R<V> {
        if len <= MAX_ATOM_LEN as u64 {
            let b = self.inp.take(len as usize)?;
            Ok(str_value(b))
        } else {
            self.inp.skip(len)?;
            Ok(V::Str(None))
        }
    }

    fn run(&mut self) -> R<V> {
        loop {
            let op = self.inp.byte()?;
            match op {
                // STOP
                b'.' => {
                    // The budget's bookkeeping adds up (checked in the unit tests).
                    #[cfg(test)]
                    assert_eq!(
                        self.live,
                        self.stack.iter().map(V::weight).sum::<u64>()
                            + (self.marks.len() + self.memo.len() + self.sparse.len()) as u64
                            + self.memo_nums.len() as u64,
                        "live count"
                    );
                    return match self.stack.pop() {
                        Some(v) => Ok(v),
                        None => self.err("malformed pickle: STOP with an empty stack"),
                    };
                }
                // MARK
                b'(' => {
                    self.marks.push(self.stack.len());
                    self.live += 1;
                    self.budget()?;
                }
                // POP: a value, or the mark when nothing is above it
                b'0' => {
                    let floor = self.marks.last().copied();
                    if floor == Some(self.stack.len()) {
                        self.marks.pop();
                        self.live -= 1;
                    } else {
                        self.pop()?;
                    }
                }
                // POP_MARK
                b'1' => {
                    self.pop_mark()?;
                    self.scratch.clear();
                }
                // DUP: a container's copy is a second reference
                b'2' => {
                    let v = self.pop()?;
                    let copy = V::from_scalar(v.scalar());
                    self.push(v)?;
                    self.push(copy)?;
                }
                // FLOAT, INT, LONG (text)
                b'F' => {
                    let mut l = std::mem::take(&mut self.line);
                    self.inp.line(&mut l)?;
                    let v = std::str::from_utf8(&l)
                        .ok()
                        .and_then(|s| s.trim().parse::<f64>().ok())
                        .map_or(V::Other, V::Float);
                    self.line = l;
                    self.push(v)?;
                }
                b'I' | b'L' => {
                    let mut l = std::mem::take(&mut self.line);
                    self.inp.line(&mut l)?;
                    let v = match &l[..] {
                        b"00" if op == b'I' => V::Bool(false),
                        b"01" if op == b'I' => V::Bool(true),
                        t => int_from_text(t),
                    };
                    self.line = l;
                    self.push(v)?;
                }
                // BININT, BININT1, BININT2
                b'J' => {
                    let u = self.inp.uint(4)? as u32;
                    self.push(V::Int(i64::from(u as i32)))?;
                }
                b'K' => {
                    let u = self.inp.uint(1)?;
                    self.push(V::Int(u as i64))?;
                }
                b'M' => {
                    let u = self.inp.uint(2)?;
                    self.push(V::Int(u as i64))?;
                }
                // LONG1, LONG4
                0x8a | 0x8b => {
                    let n = self.inp.uint(if op == 0x8a { 1 } else { 4 })?;
                    let v = if n <= 16 {
                        int_from_le(self.inp.take(n as usize)?)
                    } else {
                        self.inp.skip(n)?;
                        V::BigInt
                    };
                    self.push(v)?;
                }
                // BINFLOAT (big-endian)
                b'G' => {
                    let b = self.inp.take(8)?;
                    let x = f64::from_bits(b.iter().fold(0u64, |a, &x| (a << 8) | u64::from(x)));
                    self.push(V::Float(x))?;
                }
                b'N' => self.push(V::None)?,
                0x88 => self.push(V::Bool(true))?,
                0x89 => self.push(V::Bool(false))?,
                // STRING, UNICODE (text): quotes and escapes of a known string are plain
                b'S' | b'V' => {
                    let mut l = std::mem::take(&mut self.line);
                    self.inp.line(&mut l)?;
                    let t = if op == b'S' && l.len() >= 2 && (l[0] == b'\'' || l[0] == b'"') {
                        &l[1..l.len() - 1]
                    } else {
                        &l[..]
                    };
                    let v = str_value(t);
                    self.line = l;
                    self.push(v)?;
                }
                // BINSTRING, BINUNICODE, BINBYTES (4-byte length)
                b'T' | b'X' | b'B' => {
                    let n = self.inp.uint(4)?;
                    let v = self.counted_str(n)?;
                    self.push(v)?;
                }
                // SHORT_BINSTRING, SHORT_BINBYTES, SHORT_BINUNICODE (1-byte length)
                b'U' | b'C' | 0x8c => {
                    let n = self.inp.uint(1)?;
                    let v = self.counted_str(n)?;
                    self.push(v)?;
                }
                // BINUNICODE8, BINBYTES8, BYTEARRAY8
                0x8d | 0x8e | 0x96 => {
                    let n = self.inp.uint(8)?;
                    let v = self.counted_str(n)?;
                    self.push(if op == 0x96 { V::Other } else { v })?;
                }
                b'}' => self.push(V::Dict(Box::new(Dict::new())))?,
                b']' => self.push(V::List(Box::new(List::new())))?,
                b')' => self.push(V::List(Box::new(List::new())))?,
                // DICT, LIST, TUPLE: from the items above the mark
                b'd' => {
                    self.pop_mark()?;
                    let items = std::mem::take(&mut self.scratch);
                    self.push(V::Dict(Box::new(Dict::new())))?;
                    self.set_items(items)?;
                }
                b'l' | b't' => {
                    self.pop_mark()?;
                    let items = std::mem::take(&mut self.scratch);
                    self.push(V::List(Box::new(List::new())))?;
                    self.append_items(items)?;
                }
                // TUPLE1..3
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let mut items = std::mem::take(&mut self.scratch);
                    items.clear();
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push(V::List(Box::new(List::new())))?;
                    self.append_items(items)?;
                }
                // APPEND, SETITEM
                b'a' => {
                    let v = self.pop()?;
                    let mut items = std::mem::take(&mut self.scratch);
                    items.clear();
                    items.push(v);
                    self.append_items(items)?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    let mut items = std::mem::take(&mut self.scratch);
                    items.clear();
                    items.push(k);
                    items.push(v);
                    self.set_items(items)?;
                }
                // APPENDS, SETITEMS
                b'e' => self.batch(false)?,
                b'u' => self.batch(true)?,
                // EMPTY_SET; ADDITEMS; FROZENSET: sets are not kept
                0x8f => self.push(V::Other)?,
                0x90 => {
                    self.pop_mark()?;
                    self.scratch.clear();
                    self.pop()?;
                    self.push(V::Other)?;
                }
                0x91 => {
                    self.pop_mark()?;
                    self.scratch.clear();
                    self.push(V::Other)?;
                }
                // Objects: globals, calls and builds are opaque.
                b'c' => {
                    let mut l = std::mem::take(&mut self.line);
                    self.inp.line(&mut l)?;
                    self.inp.line(&mut l)?;
                    self.line = l;
                    self.push(V::Other)?;
                }
                0x93 => {
                    self.pop()?;
                    self.pop()?;
                    self.push(V::Other)?;
                }
                b'R' | 0x81 => {
                    self.pop()?;
                    self.pop()?;
                    self.push(V::Other)?;
                }
                0x92 => {
                    self.pop()?;
                    self.pop()?;
                    self.pop()?;
                    self.push(V::Other)?;
                }
                // BUILD: the state is dropped, the object stays
                b'b' => {
                    self.pop()?;
                    self.top_mut()?;
                }
                // INST, OBJ
                b'i' | b'o' => {
                    if op == b'i' {
                        let mut l = std::mem::take(&mut self.line);
                        self.inp.line(&mut l)?;
                        self.inp.line(&mut l)?;
                        self.line = l;
                    }
                    self.pop_mark()?;
                    self.scratch.clear();
                    self.push(V::Other)?;
                }
                // PERSID, BINPERSID
                b'P' => {
                    let mut l = std::mem::take(&mut self.line);
                    self.inp.line(&mut l)?;
                    self.line = l;
                    self.push(V::Other)?;
                }
                b'Q' => {
                    self.pop()?;
                    self.push(V::Other)?;
                }
                // EXT1, EXT2, EXT4
                0x82..=0x84 => {
                    self.inp.skip([1, 2, 4][usize::from(op - 0x82)])?;
                    self.push(V::Other)?;
                }
                // NEXT_BUFFER, READONLY_BUFFER
                0x97 => self.push(V::Other)?,
                0x98 => {
                    self.top_mut()?;
                }
                // PROTO, FRAME: nothing to do
                0x80 => {
                    let p = self.inp.byte()?;
                    if p > 5 {
                        return self.err(&format!("unsupported pickle protocol {p}"));
                    }
                }
                0x95 => self.inp.skip(8)?,
                // The memo.
                b'g' | b'p' => {
                    let mut l = std::mem::take(&mut self.line);
                    self.inp.line(&mut l)?;
                    let idx = std::str::from_utf8(&l)
                        .ok()
                        .and_then(|s| s.trim().parse().ok());
                    self.line = l;
                    let Some(idx) = idx else {
                        return self.err("bad memo index");
                    };
                    if op == b'g' {
                        self.memo_get(idx)?
                    } else {
                        self.memo_put(idx)?
                    }
                }
                b'h' => {
                    let i = self.inp.uint(1)?;
                    self.memo_get(i)?;
                }
                b'j' => {
                    let i = self.inp.uint(4)?;
                    self.memo_get(i)?;
                }
                b'q' => {
                    let i = self.inp.uint(1)?;
                    self.memo_put(i)?;
                }
                b'r' => {
                    let i = self.inp.uint(4)?;
                    self.memo_put(i)?;
                }
                0x94 => {
                    let i = self.memo.len() as u64;
                    self.memo_put(i)?;
                }
                other => {
                    return bad(format!(
                        "unsupported pickle opcode {other:#04x} at byte {}",
                        self.inp.offset() - 1
                    ))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dec(b: &[u8]) -> Result<V, String> {
        decode(b).map_err(|e| match e {
            DecodeError::Bad(m) => m,
            DecodeError::Io(e) => e.to_string(),
        })
    }

    /// A pickle builder: protocol 4 opcodes, written by hand.
    #[derive(Default)]
    struct P(Vec<u8>);

    impl P {
        fn op(mut self, b: &[u8]) -> P {
            self.0.extend_from_slice(b);
            self
        }
        fn s(self, s: &str) -> P {
            let mut p = self.op(&[0x8c, s.len() as u8]);
            p.0.extend_from_slice(s.as_bytes());
            p
        }
        fn int(self, i: i32) -> P {
            let mut p = self.op(b"J");
            p.0.extend_from_slice(&i.to_le_bytes());
            p
        }
        fn long(self, b: &[u8]) -> P {
            let p = self.op(&[0x8a, b.len() as u8]);
            p.op(b)
        }
        fn done(self) -> Vec<u8> {
            self.op(b".").0
        }
    }

    fn entry(p: P, action: &str, addr: i32, size: i32) -> P {
        // {action, addr, size, stream, frames: [{name: ...}, {...}]} with memoized keys
        p.op(b"}\x94(")
            .s("action")
            .s(action)
            .op(b"\x94")
            .s("addr")
            .int(addr)
            .s("size")
            .int(size)
            .s("stream")
            .int(0)
            .s("frames")
            .op(b"]\x94(}\x94(")
            .s("name")
            .s("forward")
            .s("line")
            .int(7)
            .op(b"u}(")
            .s("name")
            .s("x")
            .op(b"ue")
            .op(b"u")
    }

    #[test]
    fn a_snapshot_keeps_entries_and_drops_frames() {
        let mut p = P::default()
            .op(b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00}\x94(")
            .s("device_traces")
            .op(b"](](");
        p = entry(p, "alloc", 4096, 100);
        p = entry(p, "free_requested", 4096, 100);
        let b = p.op(b"ee").s("junk").op(b"]\x94u").done();
        let v = dec(&b).unwrap();
        let top = v.as_dict().unwrap();
        assert!(top.get(Atom::Segments).is_none());
        let dt = top.get(Atom::DeviceTraces).unwrap().as_list().unwrap();
        assert_eq!(dt.len(), 1);
        let dev = dt.item(0);
        let dev = dev.as_list().unwrap();
        assert_eq!(dev.len(), 2);
        // Frames and unknown keys are dropped: the entries are compact.
        assert!(matches!(dev.items, Items::Entries(_)));
        let e = dev.item(1).entry().unwrap();
        assert_eq!(e.action, S::Str(Some(Atom::FreeRequested)));
        assert_eq!(e.field(0), Some(S::Int(4096)));
        assert_eq!(e.field(1), Some(S::Int(100)));
        assert_eq!(e.field(2), Some(S::Int(0)));
    }

    #[test]
    fn memo_refs_resolve_scalars_and_read_containers_as_shared() {
        // memo 0 = "action", 1 = "alloc", 2 = a frame list; then refs to each.
        let b = P::default()
            .op(b"\x80\x04](")
            .op(b"}(")
            .s("action")
            .op(b"\x94")
            .s("alloc")
            .op(b"\x94")
            .s("addr")
            .long(&[0, 0, 0, 0, 0x7f])
            .s("frames")
            .op(b"]\x94u")
            .op(b"}(h\x00h\x01")
            .s("addr")
            .op(b"r\x10\x00\x00\x00j\x10\x00\x00\x00")
            .op(b"ue")
            .op(b"(h\x02e")
            .done();
        let v = dec(&b).unwrap();
        let l = v.as_list().unwrap();
        assert_eq!(l.len(), 3);
        let e0 = l.item(0).entry().unwrap();
        assert_eq!(e0.action, S::Str(Some(Atom::Alloc)));
        assert_eq!(e0.field(0), Some(S::Int(0x7f_0000_0000)));
        let e1 = l.item(1).entry().unwrap();
        assert_eq!(e1.action, S::Str(Some(Atom::Alloc)));
        // addr is itself memoized (sparse index 16) and fetched back: a string.
        assert_eq!(e1.field(0), Some(S::Str(Some(Atom::Addr))));
        // The third item is a reference to the (dropped) frame list: not a dict.
        assert!(l.item(2).entry().is_none());
    }

    #[test]
    fn real_snapshots_decode_with_the_budget_bookkeeping_adding_up() {
        // The STOP handler checks the live count against a recount in test builds.
        let p = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/torch-small.pickle");
        let v = dec(&std::fs::read(p).unwrap()).unwrap();
        let top = v.as_dict().unwrap();
        assert!(top.get(Atom::Segments).and_then(V::as_list).is_some());
        assert!(top
            .get(Atom::AllocatorSettings)
            .and_then(V::as_dict)
            .is_some());
    }

    #[test]
    fn integers_of_every_width() {
        assert!(matches!(int_from_le(&[0xff]), V::Int(-1)));
        assert!(matches!(int_from_le(&[0xff, 0x00]), V::Int(255)));
        assert!(matches!(int_from_le(&[0; 9]), V::Int(0)));
        let big = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00];
        assert!(matches!(int_from_le(&big), V::UInt(u64::MAX)));
        assert!(matches!(
            int_from_le(&[0, 0, 0, 0, 0, 0, 0, 0, 1]),
            V::BigInt
        ));
        assert!(matches!(
            int_from_le(&[0, 0, 0, 0, 0, 0, 0, 0x80]),
            V::Int(i64::MIN)
        ));
        assert!(matches!(int_from_text(b"123L"), V::Int(123)));
        assert!(matches!(
            int_from_text(b"18446744073709551615"),
            V::UInt(u64::MAX)
        ));
        assert!(matches!(
            int_from_text(b"-99999999999999999999999"),
            V::BigInt
        ));
    }

    #[test]
    fn protocol_0_pickles_decode() {
        // (dp0\nVaction\np1\nVfree\np2\nsVsize\nI12\ns. : {action: "free", size: 12}
        let b = b"(dp0\nVaction\np1\nVfree\np2\nsVsize\np3\nI12\nsg1\ng2\ns.";
        let v = dec(b).unwrap();
        let d = v.as_dict().unwrap();
        assert_eq!(
            d.get(Atom::Action).unwrap().scalar(),
            S::Str(Some(Atom::Free))
        );
        assert_eq!(d.get(Atom::Size).unwrap().scalar(), S::Int(12));
    }

    #[test]
    fn truncated_and_malformed_input_is_an_error_not_a_panic() {
        let good = {
            let p = P::default()
                .op(b"\x80\x04}\x94(")
                .s("device_traces")
                .op(b"]]");
            entry(p, "alloc", 1, 2).op(b"aau").done()
        };
        dec(&good).unwrap();
        for n in 0..good.len() {
            let e = dec(&good[..n]).unwrap_err();
            assert!(
                e.contains("truncated") || e.contains("malformed"),
                "{n}: {e}"
            );
        }
        for b in [
            &b"a."[..],
            b"h\x05.",
            b"\xff",
            b"J\x01",
            b"(u.",
            b"]}u.",
            b"}]a.",
            b"1.",
            b"(N0N0.",
            b"N(s.",
            b"\x80\x09.",
            b"\x8d\xff\xff\xff\xff\xff\xff\xff\xff.",
        ] {
            assert!(dec(b).is_err(), "{b:?}");
        }
        let e = dec(b"\xff").unwrap_err();
        assert!(
            e.contains("unsupported pickle opcode 0xff at byte 0"),
            "{e}"
        );
    }

    /// A list, then `depth` times "a list holding the previous one twice" (memo refs):
    /// 2^depth nodes for a decoder that copies at references.
    fn bomb(depth: u8) -> Vec<u8> {
        let mut p = vec![0x80, 2, b']', b'q', 0];
        for i in 0..depth {
            p.extend_from_slice(&[b'(', b'h', i, b'h', i, b'l', b'q', i + 1]);
        }
        p.push(b'.');
        p
    }

    #[test]
    fn a_reference_bomb_costs_nothing() {
        let v = dec(&bomb(200)).unwrap();
        let l = v.as_list().unwrap();
        assert_eq!(l.len(), 2);
        // Second references in a list are only counted.
        assert!(l.item(0).as_list().is_none());
        assert!(matches!(l.items, Items::Scalars(2)));
    }

    #[test]
    fn deep_nesting_and_floods_are_refused() {
        // 100 nested lists: ]]]...]aaa...a
        let mut b = vec![b']'; 100];
        b.extend(vec![b'a'; 99]);
        b.push(b'.');
        let e = dec(&b).unwrap_err();
        assert!(e.contains("nested more than 32"), "{e}");
        // 31 deep is fine.
        let mut b = vec![b']'; 31];
        b.extend(vec![b'a'; 30]);
        b.push(b'.');
        dec(&b).unwrap();
        // A flood of values kept in a list: more than the budget allows for its size.
        let n = 3 << 20;
        let mut b = b"](".to_vec();
        b.extend(std::iter::repeat_n(b'N', n));
        b.extend_from_slice(b"e.");
        let e = dec(&b).unwrap_err();
        assert!(e.contains("keeps more than"), "{e}");
        // The same flood dropped as a dict value under an unknown key is fine.
        let mut b = b"}(\x8c\x01x](".to_vec();
        b.extend(std::iter::repeat_n(b'N', 100_000));
        b.extend_from_slice(b"eu.");
        dec(&b).unwrap();
    }

    #[test]
    fn a_mixed_list_keeps_every_item_in_order() {
        let b = P::default()
            .op(b"](}(")
            .s("action")
            .s("alloc")
            .s("addr")
            .int(5)
            .op(b"uN}(")
            .s("device")
            .int(3)
            .op(b"ue.")
            .0;
        let v = dec(&b).unwrap();
        let l = v.as_list().unwrap();
        assert_eq!(l.len(), 3);
        assert_eq!(l.item(0).get(Atom::Addr), Ok(Some(S::Int(5))));
        assert_eq!(
            l.item(0).get(Atom::Action),
            Ok(Some(S::Str(Some(Atom::Alloc))))
        );
        assert!(l.item(1).get(Atom::Addr).is_err());
        assert_eq!(l.item(2).get(Atom::Device), Ok(Some(S::Int(3))));
        assert_eq!(l.item(2).entry().map(|e| e.has_action()), Some(false));
    }
}
