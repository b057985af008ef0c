//! A bound on what a pickle expands to, checked before it is decoded.
//!
//! A pickle can refer to an earlier object again (memo `GET`), and a decoder that builds a
//! tree copies the object at each reference: a few hundred bytes that nest references can
//! expand to gigabytes (found by the `trace_text` fuzz target: 560 bytes, over 6 GB).
//! [`check_expansion`] walks the opcodes with a stack of node counts instead of values, so it
//! needs memory proportional to the input, and refuses a pickle whose decoded tree would hold
//! more than a budget of nodes. Real snapshots expand to about one node per few input bytes.
#![forbid(unsafe_code)]

/// Nodes allowed per input byte, on top of [`BASE_NODES`].
const NODES_PER_BYTE: u64 = 16;
/// Nodes allowed for any input.
const BASE_NODES: u64 = 1_000_000;

/// A stack slot: a value of so many nodes, or a mark.
#[derive(Copy, Clone)]
enum Slot {
    Mark,
    Nodes(u64),
}

struct Walk<'a> {
    b: &'a [u8],
    pos: usize,
    stack: Vec<Slot>,
    memo: std::collections::HashMap<u64, u64>,
    limit: u64,
}

type R<T> = Result<T, String>;

impl<'a> Walk<'a> {
    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| format!("truncated pickle at byte {}", self.pos))?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn uint(&mut self, n: usize) -> R<u64> {
        let s = self.take(n)?;
        Ok(s.iter()
            .rev()
            .fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
    }

    /// Skip a length-prefixed argument whose length takes `n` bytes.
    fn skip_counted(&mut self, n: usize) -> R<()> {
        let len = self.uint(n)?;
        let len = usize::try_from(len).map_err(|_| "pickle length too large".to_string())?;
        self.take(len).map(|_| ())
    }

    fn line(&mut self) -> R<&'a [u8]> {
        let rest = &self.b[self.pos..];
        let n = rest
            .iter()
            .position(|&c| c == b'\n')
            .ok_or_else(|| format!("unterminated line in pickle at byte {}", self.pos))?;
        self.take(n + 1)
    }

    fn push(&mut self, nodes: u64) -> R<()> {
        if nodes > self.limit {
            return Err(format!(
                "the pickle would expand to more than {} objects (nested references); refused",
                self.limit
            ));
        }
        self.stack.push(Slot::Nodes(nodes));
        Ok(())
    }

    fn pop(&mut self) -> R<u64> {
        match self.stack.pop() {
            Some(Slot::Nodes(n)) => Ok(n),
            _ => Err(format!("malformed pickle at byte {}", self.pos)),
        }
    }

    /// Pop everything down to the topmost mark (removed too); the sum of their nodes.
    fn pop_mark(&mut self) -> R<u64> {
        let mut sum = 0u64;
        loop {
            match self.stack.pop() {
                Some(Slot::Mark) => return Ok(sum),
                Some(Slot::Nodes(n)) => sum = sum.saturating_add(n),
                None => return Err(format!("malformed pickle at byte {}", self.pos)),
            }
        }
    }

    /// Add `n` nodes to the value on top of the stack.
    fn grow_top(&mut self, n: u64) -> R<()> {
        let top = self.pop()?;
        self.push(top.saturating_add(n))
    }

    fn memo_put(&mut self, idx: u64) -> R<()> {
        match self.stack.last() {
            Some(&Slot::Nodes(n)) => {
                self.memo.insert(idx, n);
                Ok(())
            }
            _ => Err(format!("malformed pickle at byte {}", self.pos)),
        }
    }

    fn memo_get(&mut self, idx: u64) -> R<()> {
        let n = *self
            .memo
            .get(&idx)
            .ok_or_else(|| format!("pickle refers to unknown memo entry {idx}"))?;
        self.push(n)
    }

    /// The memo index argument of a GET / PUT opcode: a text line (`g`, `p`), one byte
    /// (`h`, `q`) or four bytes (`j`, `r`).
    fn memo_index(&mut self, op: u8) -> R<u64> {
        match op {
            b'g' | b'p' => {
                let l = self.line()?;
                std::str::from_utf8(&l[..l.len() - 1])
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .ok_or_else(|| "bad memo index in pickle".to_string())
            }
            b'h' | b'q' => self.uint(1),
            _ => self.uint(4),
        }
    }

    fn run(&mut self) -> R<()> {
        loop {
            let op = self.take(1)?[0];
            match op {
                b'.' => return Ok(()),
                b'(' => self.stack.push(Slot::Mark),
                b'0' => {
                    self.stack
                        .pop()
                        .ok_or_else(|| "malformed pickle: POP of an empty stack".to_string())?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let top = self.pop()?;
                    self.push(top)?;
                    self.push(top)?;
                }
                // Scalars with an argument.
                b'F' | b'I' | b'L' | b'S' | b'V' | b'P' => {
                    self.line()?;
                    self.push(1)?;
                }
                b'J' => self.take(4).and_then(|_| self.push(1))?,
                b'K' => self.take(1).and_then(|_| self.push(1))?,
                b'M' => self.take(2).and_then(|_| self.push(1))?,
                b'G' => self.take(8).and_then(|_| self.push(1))?,
                b'T' | b'X' | b'B' => self.skip_counted(4).and_then(|_| self.push(1))?,
                b'U' | b'C' | 0x8c => self.skip_counted(1).and_then(|_| self.push(1))?,
                0x8a => self.skip_counted(1).and_then(|_| self.push(1))?,
                0x8b => self.skip_counted(4).and_then(|_| self.push(1))?,
                0x8d | 0x8e | 0x96 => self.skip_counted(8).and_then(|_| self.push(1))?,
                b'N' | 0x88 | 0x89 | b'}' | b']' | b')' | 0x8f | 0x97 => self.push(1)?,
                b'c' => {
                    self.line()?;
                    self.line()?;
                    self.push(1)?;
                }
                0x82 => self.take(1).and_then(|_| self.push(1))?,
                0x83 => self.take(2).and_then(|_| self.push(1))?,
                0x84 => self.take(4).and_then(|_| self.push(1))?,
                b'Q' => {
                    self.pop()?;
                    self.push(1)?;
                }
                0x98 => {}
                0x80 => {
                    self.take(1)?;
                }
                0x95 => {
                    self.take(8)?;
                }
                // Containers built from a mark.
                b'l' | b't' | b'd' | 0x91 | b'o' => {
                    let sum = self.pop_mark()?;
                    self.push(sum.saturating_add(1))?;
                }
                b'i' => {
                    self.line()?;
                    self.line()?;
                    let sum = self.pop_mark()?;
                    self.push(sum.saturating_add(1))?;
                }
                0x85..=0x87 => {
                    let mut sum = 1u64;
                    for _ in 0..(op - 0x84) {
                        sum = sum.saturating_add(self.pop()?);
                    }
                    self.push(sum)?;
                }
                // Items added to the container below.
                b'a' | b'b' => {
                    let x = self.pop()?;
                    self.grow_top(x)?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.grow_top(k.saturating_add(v))?;
                }
                b'e' | b'u' | 0x90 => {
                    let sum = self.pop_mark()?;
                    self.grow_top(sum)?;
                }
                // Calls: the result counts its arguments (a decoder may keep them).
                b'R' | 0x81 => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    self.push(args.saturating_add(callable).saturating_add(1))?;
                }
                0x92 => {
                    let kw = self.pop()?;
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    self.push(
                        kw.saturating_add(args)
                            .saturating_add(cls)
                            .saturating_add(1),
                    )?;
                }
                0x93 => {
                    self.pop()?;
                    self.pop()?;
                    self.push(1)?;
                }
                // The memo.
                b'g' | b'h' | b'j' => {
                    let i = self.memo_index(op)?;
                    self.memo_get(i)?;
                }
                b'p' | b'q' | b'r' => {
                    let i = self.memo_index(op)?;
                    self.memo_put(i)?;
                }
                0x94 => {
                    let i = self.memo.len() as u64;
                    self.memo_put(i)?;
                }
                other => {
                    return Err(format!(
                        "unsupported pickle opcode {other:#04x} at byte {}",
                        self.pos - 1
                    ))
                }
            }
        }
    }
}

/// Refuse a pickle whose decoded tree would hold more than `1,000,000 + 16 x len` objects,
/// or that is malformed in a way the walk notices. Memory and time are linear in the input.
pub(crate) fn check_expansion(bytes: &[u8]) -> Result<(), String> {
    let mut w = Walk {
        b: bytes,
        pos: 0,
        stack: Vec::new(),
        memo: std::collections::HashMap::new(),
        limit: BASE_NODES.saturating_add(NODES_PER_BYTE.saturating_mul(bytes.len() as u64)),
    };
    w.run()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A protocol-2 pickle: a list, then `depth` times "a list holding the previous one
    /// twice" (through the memo), so the decoded tree has about 2^depth nodes.
    fn bomb(depth: u8) -> Vec<u8> {
        let mut p = vec![0x80, 2, b']', b'q', 0];
        for i in 0..depth {
            // mark, memo[i] twice, list from the mark, memo[i + 1] = it
            p.extend_from_slice(&[b'(', b'h', i, b'h', i, b'l', b'q', i + 1]);
        }
        p.push(b'.');
        p
    }

    #[test]
    fn a_reference_bomb_is_refused_and_a_small_pickle_passes() {
        // Small: passes.
        check_expansion(&bomb(4)).unwrap();
        // 2^40 nodes from a few hundred bytes: refused without building anything.
        let e = check_expansion(&bomb(40)).unwrap_err();
        assert!(e.contains("expand"), "{e}");
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        for bad in [&b""[..], b"\x80", b"(", b"a.", b"h\x05.", b"\xff", b"J\x01"] {
            assert!(check_expansion(bad).is_err(), "{bad:?}");
        }
    }
}
