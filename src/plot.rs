//! Pictures as SVG text: memory over a replay ([`timeline_svg`]) and the allocator's address
//! space at one moment ([`map_svg`]). Hand-written SVG, no dependencies.
//!
//! ```
//! use stitch_alloc::plot::timeline_svg;
//! use stitch_alloc::replay::Timeline;
//! let t = Timeline { live: vec![1 << 30, 2 << 30, 1 << 30], reserved: vec![2 << 30; 3], ..Default::default() };
//! let svg = timeline_svg(&t, "example");
//! assert!(svg.starts_with("<svg") && svg.contains("reserved"));
//! ```
#![forbid(unsafe_code)]

use crate::replay::Timeline;
use crate::Layout;
use std::fmt::Write;

const W: f64 = 1000.0;
const H: f64 = 500.0;
const ML: f64 = 80.0;
const MR: f64 = 20.0;
const MT: f64 = 50.0;
const MB: f64 = 55.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn unit_for(max: u64) -> (f64, &'static str) {
    if max >= 1 << 30 {
        ((1u64 << 30) as f64, "GiB")
    } else if max >= 1 << 20 {
        ((1u64 << 20) as f64, "MiB")
    } else {
        (1024.0, "KiB")
    }
}

/// A "nice" tick step covering `span` in about `n` steps.
fn nice_step(span: f64, n: f64) -> f64 {
    if span <= 0.0 {
        return 1.0;
    }
    let raw = span / n;
    let p = 10f64.powf(raw.log10().floor());
    let m = raw / p;
    let m = if m <= 1.0 {
        1.0
    } else if m <= 2.0 {
        2.0
    } else if m <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * p
}

/// Min/max envelope of `v` in at most `buckets` buckets: up to `2 * buckets` (index, value)
/// points, in order.
fn envelope(v: &[u64], buckets: usize) -> Vec<(usize, u64)> {
    if v.len() <= 2 * buckets {
        return v.iter().copied().enumerate().collect();
    }
    let per = v.len().div_ceil(buckets);
    let mut out = Vec::with_capacity(2 * buckets);
    for (b, chunk) in v.chunks(per).enumerate() {
        let base = b * per;
        let (mut imin, mut imax) = (0, 0);
        for (i, &x) in chunk.iter().enumerate() {
            if x < chunk[imin] {
                imin = i;
            }
            if x > chunk[imax] {
                imax = i;
            }
        }
        let (a, c) = if imin <= imax {
            (imin, imax)
        } else {
            (imax, imin)
        };
        out.push((base + a, chunk[a]));
        if c != a {
            out.push((base + c, chunk[c]));
        }
    }
    out
}

/// Live (requested) and reserved (physical) bytes over the event index, at most 2,000
/// points per series; stitches are marked as green ticks along the top, failed allocations
/// as red lines, probes as purple dashed lines.
pub fn timeline_svg(t: &Timeline, title: &str) -> String {
    let n = t.live.len().max(1);
    let ymax_raw = t
        .reserved
        .iter()
        .chain(t.live.iter())
        .copied()
        .max()
        .unwrap_or(0)
        .max(1);
    let (unit, uname) = unit_for(ymax_raw);
    let ymax_u = ymax_raw as f64 / unit * 1.08;
    let ystep = nice_step(ymax_u, 6.0);
    let ytop = (ymax_u / ystep).ceil() * ystep;
    let pw = W - ML - MR;
    let ph = H - MT - MB;
    let x = |i: usize| ML + pw * (i as f64) / ((n.max(2) - 1) as f64);
    let y = |b: u64| MT + ph * (1.0 - (b as f64 / unit) / ytop);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    s.push('\n');
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"#,
        W / 2.0,
        esc(title)
    );
    // Grid and axes.
    let mut v = 0.0;
    while v <= ytop + 1e-9 {
        let yy = MT + ph * (1.0 - v / ytop);
        let _ = writeln!(
            s,
            r##"<line x1="{ML}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            W - MR,
            ML - 6.0,
            yy + 4.0,
            trim_num(v)
        );
        v += ystep;
    }
    let xstep = nice_step(n as f64, 6.0).max(1.0);
    let mut xi = 0.0;
    while xi < n as f64 {
        let xx = x(xi as usize);
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.1}" y1="{MT}" x2="{xx:.1}" y2="{:.1}" stroke="#eee"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            H - MB,
            H - MB + 16.0,
            trim_num(xi)
        );
        xi += xstep;
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">event index</text>"#,
        ML + pw / 2.0,
        H - 12.0
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">{uname}</text>"#,
        MT + ph / 2.0,
        MT + ph / 2.0
    );
    let _ = writeln!(
        s,
        r##"<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>"##
    );
    // Marks below the curves.
    let mut last_px = -1i64;
    for &i in &t.ooms {
        let px = x(i).round() as i64;
        if px != last_px {
            let _ = writeln!(
                s,
                r##"<line x1="{px}" y1="{MT}" x2="{px}" y2="{:.1}" stroke="#d62728" stroke-opacity="0.5"/>"##,
                H - MB
            );
            last_px = px;
        }
    }
    for &i in &t.probes {
        let px = x(i);
        let _ = writeln!(
            s,
            r##"<line x1="{px:.1}" y1="{MT}" x2="{px:.1}" y2="{:.1}" stroke="#9467bd" stroke-dasharray="6 4" stroke-width="1.5"/>"##,
            H - MB
        );
    }
    // Series.
    for (series, color, width) in [(&t.reserved, "#ff7f0e", 2.0), (&t.live, "#1f77b4", 1.5)] {
        if series.is_empty() {
            continue;
        }
        let pts = envelope(series, 1000);
        let mut d = String::with_capacity(pts.len() * 14);
        for (k, (i, b)) in pts.iter().enumerate() {
            let _ = write!(
                d,
                "{}{:.1},{:.1}",
                if k == 0 { "M" } else { " L" },
                x(*i),
                y(*b)
            );
        }
        let _ = writeln!(
            s,
            r#"<path d="{d}" fill="none" stroke="{color}" stroke-width="{width}" stroke-linejoin="round"/>"#
        );
    }
    let mut last_px = -1i64;
    for &i in &t.stitches {
        let px = x(i).round() as i64;
        if px != last_px {
            let _ = writeln!(
                s,
                r##"<line x1="{px}" y1="{MT}" x2="{px}" y2="{:.1}" stroke="#2ca02c" stroke-width="1.5"/>"##,
                MT + 9.0
            );
            last_px = px;
        }
    }
    // Legend.
    let items = [
        ("#ff7f0e", "reserved (physical)".to_string()),
        ("#1f77b4", "live (requested)".to_string()),
        ("#2ca02c", format!("stitch ({})", t.stitches.len())),
        ("#d62728", format!("failed alloc ({})", t.ooms.len())),
        ("#9467bd", format!("probe ({})", t.probes.len())),
    ];
    let mut lx = ML + 10.0;
    for (c, label) in items {
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.1}" y="{:.1}" width="14" height="4" fill="{c}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            MT + 18.0,
            lx + 18.0,
            MT + 23.0,
            esc(&label)
        );
        lx += 24.0 + 7.0 * label.len() as f64;
    }
    s.push_str("</svg>\n");
    s
}

fn trim_num(v: f64) -> String {
    if v.fract().abs() < 1e-9 {
        format!("{}", v as i64)
    } else {
        format!("{v:.2}").trim_end_matches('0').to_string()
    }
}

fn gib(b: u64) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

/// The classes a byte of mapped memory can be in, with their colours.
const CLASSES: [(&str, &str); 5] = [
    ("live", "#1f77b4"),
    ("free", "#2ca02c"),
    ("stranded (free, in a handle holding live bytes)", "#d62728"),
    ("dirty (freed, not yet fenced)", "#ffbf00"),
    ("pending (cross-stream free)", "#ff7f0e"),
];

/// The allocator's virtual address space: every contiguously mapped run, in address order,
/// laid end to end along wrapped rows (gaps between runs are not to scale). Colours: live,
/// free, stranded (free bytes inside a handle that holds live bytes), dirty, pending; thin
/// dark ticks mark handle boundaries. Owned but unmapped handles are listed below.
pub fn map_svg(snap: &Layout, title: &str) -> String {
    const ROWS: usize = 16;
    const ROW_H: f64 = 22.0;
    const ROW_GAP: f64 = 8.0;
    let top = 70.0;
    let pw = W - 40.0;
    let total_px = pw * ROWS as f64;
    let runs = &snap.runs;
    let bytes: u64 = runs.iter().flatten().map(|b| b.size).sum();
    let gap = if runs.is_empty() {
        0.0
    } else {
        (0.25 * total_px / runs.len() as f64).min(4.0)
    };
    let scale = if bytes == 0 {
        0.0
    } else {
        (total_px - gap * runs.len() as f64) / bytes as f64
    };
    // Mapped handles holding live bytes, by address: to split free blocks into stranded parts.
    let mut live_handles: Vec<(u64, u64)> = snap
        .handles
        .iter()
        .filter(|h| h.holds_live)
        .filter_map(|h| h.addr.map(|a| (a, h.size)))
        .collect();
    live_handles.sort_unstable();
    let mut handle_starts: Vec<u64> = snap.handles.iter().filter_map(|h| h.addr).collect();
    handle_starts.sort_unstable();

    // Linear pieces (class, start position in px, length in px), merged when adjacent.
    let mut pieces: Vec<(usize, f64, f64)> = Vec::new();
    let mut ticks: Vec<f64> = Vec::new();
    let mut pos = 0.0f64;
    let push = |pieces: &mut Vec<(usize, f64, f64)>, class: usize, at: f64, len: f64| {
        if len <= 0.0 {
            return;
        }
        if let Some(last) = pieces.last_mut() {
            if last.0 == class && (last.1 + last.2 - at).abs() < 1e-6 {
                last.2 += len;
                return;
            }
        }
        pieces.push((class, at, len));
    };
    for run in runs {
        let (Some(first), Some(last)) = (run.first(), run.last()) else {
            continue;
        };
        let run_start = first.addr;
        let run_end = last.addr + last.size;
        for b in run {
            let at = pos + (b.addr - run_start) as f64 * scale;
            match b.state {
                "live" => push(&mut pieces, 0, at, b.size as f64 * scale),
                "dirty" => push(&mut pieces, 3, at, b.size as f64 * scale),
                "pending" => push(&mut pieces, 4, at, b.size as f64 * scale),
                _ => {
                    // Split the free block by overlap with handles holding live bytes.
                    let (bs, be) = (b.addr, b.addr + b.size);
                    let mut cur = bs;
                    let k = live_handles.partition_point(|&(a, sz)| a + sz <= bs);
                    for &(ha, hs) in &live_handles[k..] {
                        if ha >= be {
                            break;
                        }
                        let (os, oe) = (ha.max(bs), (ha + hs).min(be));
                        if os > cur {
                            push(
                                &mut pieces,
                                1,
                                pos + (cur - run_start) as f64 * scale,
                                (os - cur) as f64 * scale,
                            );
                        }
                        if oe > os {
                            push(
                                &mut pieces,
                                2,
                                pos + (os - run_start) as f64 * scale,
                                (oe - os) as f64 * scale,
                            );
                        }
                        cur = cur.max(oe);
                    }
                    if be > cur {
                        push(
                            &mut pieces,
                            1,
                            pos + (cur - run_start) as f64 * scale,
                            (be - cur) as f64 * scale,
                        );
                    }
                }
            }
        }
        let k = handle_starts.partition_point(|&a| a < run_start);
        for &a in &handle_starts[k..] {
            if a >= run_end {
                break;
            }
            ticks.push(pos + (a - run_start) as f64 * scale);
        }
        pos += (run_end - run_start) as f64 * scale + gap;
    }

    let unmapped: Vec<u64> = snap
        .handles
        .iter()
        .filter(|h| h.addr.is_none())
        .map(|h| h.size)
        .collect();
    let height = top + ROWS as f64 * (ROW_H + ROW_GAP) + 150.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{height}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"#,
        W / 2.0,
        esc(title)
    );
    let d = &snap.detailed;
    let _ = writeln!(
        s,
        r#"<text x="20" y="44">{} mapped in {} runs, {} handles ({} unmapped); live {}, reserved {}, stranded {}, largest free span {}</text>"#,
        gib(bytes),
        runs.len(),
        snap.handles.len(),
        unmapped.len(),
        gib(d.stats.requested.current),
        gib(d.stats.reserved.current),
        gib(d.stranded_bytes),
        gib(d.largest_free_span)
    );
    let _ = writeln!(
        s,
        r##"<text x="20" y="60" fill="#555">Runs of contiguously mapped memory in address order, wrapped over {ROWS} rows; gaps between runs are not to scale. Dark ticks: handle boundaries.</text>"##
    );
    let row_y = |r: usize| top + r as f64 * (ROW_H + ROW_GAP);
    for r in 0..ROWS {
        let _ = writeln!(
            s,
            r##"<rect x="20" y="{:.1}" width="{pw}" height="{ROW_H}" fill="#f4f4f4"/>"##,
            row_y(r)
        );
    }
    // Draw a linear interval, split across rows.
    let draw = |s: &mut String, at: f64, len: f64, color: &str| {
        let mut a = at;
        let end = at + len;
        while a < end - 1e-9 {
            let row = (a / pw).floor() as usize;
            if row >= ROWS {
                break;
            }
            let row_end = (row + 1) as f64 * pw;
            let e = end.min(row_end);
            let _ = writeln!(
                s,
                r#"<rect x="{:.2}" y="{:.1}" width="{:.2}" height="{ROW_H}" fill="{color}"/>"#,
                20.0 + a - row as f64 * pw,
                row_y(row),
                (e - a).max(0.3)
            );
            a = e;
        }
    };
    for &(class, at, len) in &pieces {
        draw(&mut s, at, len, CLASSES[class].1);
    }
    let mut last_px = -1.0f64;
    for &t in &ticks {
        if t - last_px < 2.0 {
            continue;
        }
        last_px = t;
        let row = (t / pw).floor() as usize;
        if row >= ROWS {
            break;
        }
        let xx = 20.0 + t - row as f64 * pw;
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.2}" y1="{:.1}" x2="{xx:.2}" y2="{:.1}" stroke="#222" stroke-width="0.7"/>"##,
            row_y(row),
            row_y(row) + ROW_H
        );
    }
    // Legend.
    let ly = row_y(ROWS) + 10.0;
    let mut lx = 20.0;
    for (label, color) in CLASSES {
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.1}" y="{ly:.1}" width="12" height="12" fill="{color}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 16.0,
            ly + 10.0,
            esc(label)
        );
        lx += 30.0 + 6.2 * label.len() as f64;
    }
    // Unmapped handles.
    let uy = ly + 40.0;
    let ubytes: u64 = unmapped.iter().sum();
    let _ = writeln!(
        s,
        r#"<text x="20" y="{uy:.1}">Owned but unmapped handles: {} ({})</text>"#,
        unmapped.len(),
        gib(ubytes)
    );
    if ubytes > 0 {
        let uscale = (pw / ubytes as f64).min(if bytes > 0 { scale } else { f64::MAX });
        let mut ux = 20.0;
        for &u in &unmapped {
            let w = u as f64 * uscale;
            let _ = writeln!(
                s,
                r##"<rect x="{ux:.2}" y="{:.1}" width="{:.2}" height="16" fill="#999" stroke="white" stroke-width="0.5"/>"##,
                uy + 8.0,
                w.max(0.3)
            );
            ux += w;
        }
    }
    s.push_str("</svg>\n");
    s
}
