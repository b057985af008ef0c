//! The PyTorch memory-snapshot reader on arbitrary bytes: an error naming the event, or a
//! valid trace; never a panic. The streaming decoder must give the same outcome whether the
//! bytes come in one slice or in reads of a few bytes (buffer refills mid-opcode).
#![no_main]

use libfuzzer_sys::fuzz_target;
use stitch_alloc::trace::pytorch::{parse_snapshot_recorded, read_snapshot};

struct Trickle<'a>(&'a [u8], usize);

impl std::io::Read for Trickle<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.1).min(self.0.len());
        buf[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        Ok(n)
    }
}

fuzz_target!(|data: &[u8]| {
    let whole = parse_snapshot_recorded(data, None);
    if let Ok((t, _)) = &whole {
        t.validate().expect("a parsed snapshot validates");
    }
    let chunk = 1 + usize::from(data.first().copied().unwrap_or(0) % 7);
    let pieces = read_snapshot(Trickle(data, chunk), None);
    match (&whole, &pieces) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        _ => panic!("slice and streamed reads disagree: {whole:?} vs {pieces:?}"),
    }
});
