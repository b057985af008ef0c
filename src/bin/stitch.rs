//! `stitch`: replay allocation traces through stitch-alloc, generate synthetic traces, and
//! show what stitching is worth (`stitch demo`).
#![forbid(unsafe_code)]

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;
use stitch_alloc::driver::sim::H200_CAPACITY;
use stitch_alloc::driver::{CudaDriver, CudaStream, Driver, HostDriver, SimDriver};
use stitch_alloc::replay::{
    models, replay, CostModel, Meter, Metered, ReplayOptions, ReplayReport,
};
use stitch_alloc::stats::Bytes;
use stitch_alloc::trace::gen::{self, Kind, Scale};
use stitch_alloc::trace::pytorch::{self, RecordedReserved};
use stitch_alloc::trace::{self, Format, ReadOptions, Trace};
use stitch_alloc::{parse_size, plot, Allocator, Backend, Capacity, Config, Stream};

/// `println!` that ignores a closed pipe (`stitch ... | head` must not panic).
macro_rules! out {
    () => {{
        use std::io::Write;
        let _ = writeln!(std::io::stdout());
    }};
    ($($t:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

#[derive(Parser)]
#[command(
    name = "stitch",
    version,
    about = "Replay GPU allocation traces through stitch-alloc and see what stitching is worth.",
    long_about = "Replay GPU allocation traces (stitch's text format or PyTorch memory \
                  snapshots) through stitch-alloc, on a simulated H200 (the default), real \
                  host memory or a GPU; see what you would save against PyTorch's own \
                  allocator; generate synthetic traces; compare stitching on and off \
                  (`stitch demo`)."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Replay a trace and report memory, fragmentation and modeled driver time.
    Replay(ReplayArgs),
    /// Generate a deterministic synthetic trace.
    Gen(GenArgs),
    /// Run a fragmenting workload with stitching on and off, side by side.
    Demo(DemoArgs),
    /// Show the backend, device, granularity and capacity.
    Info(InfoArgs),
    /// Draw the allocator's address space after a chosen event as SVG.
    Map(MapArgs),
}

/// `--backend`: the library's [`Backend`], each value explained (`auto` is the command's
/// own wording of the one rule: CUDA or an error, except in `stitch demo`).
fn backend_parser(auto: &'static str) -> impl TypedValueParser<Value = Backend> {
    let values = Backend::ALL.map(|b| {
        PossibleValue::new(b.name()).help(match b {
            Backend::Auto => auto,
            Backend::Sim => {
                "SimDriver: an accounting-only simulated GPU (default: an H200, 139.8 GiB)"
            }
            Backend::Host => {
                "HostDriver: real host memory, remapped with mmap and memfd, sized like an H200 \
                 (139.8 GiB of address space; untouched pages cost no RAM)"
            }
            Backend::Cuda => "A real GPU (device 0) through the CUDA driver, loaded at run time",
        })
    });
    PossibleValuesParser::new(values).map(|name| {
        name.parse::<Backend>()
            .expect("clap gives one of the backends' names")
    })
}

/// Help text for an allocator flag: what it sets in [`Config`] and that field's default.
fn config_help(what: &str, field: &str, default: String) -> String {
    format!("{what} (Config::{field}; default {default})")
}

/// The error of `auto` when no GPU is usable (the one rule on [`Backend`]).
const NO_GPU_HINT: &str = "name --backend sim (a simulated H200) or --backend host to run \
                           without a GPU";

/// A byte count as help text shows it.
fn size_text(b: u64) -> String {
    match b {
        0 => "0".to_string(),
        b if b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b => format!("{b} bytes"),
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum FormatArg {
    /// Detect (a pickle is a PyTorch snapshot, anything else text).
    Auto,
    /// The text format.
    Text,
    /// A PyTorch memory snapshot pickle.
    Pytorch,
}

/// The allocator's flags: each sets a field of [`Config`] (whose defaults are the only
/// ones); sizes are read by [`parse_size`], as in `STITCH_ALLOC_CONF`.
#[derive(Args, Clone)]
struct AllocArgs {
    /// The device backend (default sim: a replay is a model; name cuda to run on the GPU).
    #[arg(long, default_value = "sim", value_parser = backend_parser(
        "CUDA device 0; an error when no usable GPU and driver are found"))]
    backend: Backend,
    /// Device capacity in bytes (sim, host: the device's size, default 139.8 GiB like an
    /// H200; cuda: Config::capacity).
    /// Sizes: KiB, MiB, GiB, TiB (or K, M, G, T) are powers of 1024; kB, MB, GB, TB powers
    /// of 1000; fractions such as 1.5GiB are rounded down to a byte.
    #[arg(long, value_parser = parse_size)]
    capacity: Option<u64>,
    /// Turn stitching off (Config::stitching; the baseline: release and re-create instead).
    #[arg(long)]
    no_stitch: bool,
    #[arg(long, value_parser = parse_size, help = config_help(
        "Requests up to this size go to the small pool's pages", "small_threshold",
        size_text(Config::default().small_threshold)))]
    small_threshold: Option<u64>,
    #[arg(long, value_parser = parse_size, help = config_help(
        "Smallest handle created for a large request", "min_handle", "the granularity".into()))]
    min_handle: Option<u64>,
    #[arg(long, value_parser = parse_size, help = config_help(
        "Largest single handle", "max_handle", size_text(Config::default().max_handle)))]
    max_handle: Option<u64>,
    #[arg(long, help = config_help(
        "New large-pool memory in handles of about request / this", "handle_divisor",
        Config::default().handle_divisor.to_string()))]
    handle_divisor: Option<u64>,
    #[arg(long, value_parser = parse_size, help = config_help(
        "Smallest handle the divisor splits down to", "split_min",
        size_text(Config::default().split_min)))]
    split_min: Option<u64>,
    /// Remap free handles when stitching instead of releasing and re-creating them
    /// (Config::recreate off).
    #[arg(long)]
    no_recreate: bool,
    /// Keep stitching a loop that stitches at the same point of every step instead of giving
    /// it one run that only grows (Config::loop_region off).
    #[arg(long)]
    no_loop_region: bool,
    /// Place growing chains (a request a little larger than a live one that is freed right
    /// after, as a KV cache grown by concatenation) by best fit like any other request
    /// (Config::chain_fit off).
    #[arg(long)]
    no_chain_fit: bool,
    /// Among free handles of one size, stitch first those whose removal strands no piece of
    /// a handle shared with a live block (Config::spare_pieces on; off by default).
    #[arg(long)]
    spare_pieces: bool,
    /// Contiguous growth: map each new large span after the end of a run and link it in,
    /// so free tails coalesce with new memory (Config::contiguous; the default, so this
    /// flag only states it).
    #[arg(long, conflicts_with = "no_contiguous")]
    contiguous: bool,
    /// Place each new large span alone in fresh address space instead (Config::contiguous
    /// off; the default until contiguous growth became one).
    #[arg(long)]
    no_contiguous: bool,
    #[arg(long, help = config_help(
        "Growth slack: create new memory while reserved stays within (1 + slack) x peak live, \
         reuse (stitch) free handles past it",
        "reserve_slack", Config::default().reserve_slack.to_string()))]
    reserve_slack: Option<f64>,
    #[arg(long, value_parser = parse_size, help = config_help(
        "Floor under the growth slack, in bytes",
        "reserve_slack_min", size_text(Config::default().reserve_slack_min)))]
    reserve_slack_min: Option<u64>,
    #[arg(long, value_parser = parse_size, help = config_help(
        "Bytes created and mapped at the first allocation as one free pool",
        "prealloc", size_text(Config::default().prealloc)))]
    prealloc: Option<u64>,
    /// Check every allocator invariant after each operation (Config::paranoid; slow).
    #[arg(long)]
    paranoid: bool,
}

impl AllocArgs {
    /// Every flag at its default on `backend`, stitching on or off (the demo's runs).
    fn defaults(backend: Backend, stitching: bool) -> Self {
        AllocArgs {
            backend,
            capacity: None,
            no_stitch: !stitching,
            small_threshold: None,
            min_handle: None,
            max_handle: None,
            handle_divisor: None,
            split_min: None,
            no_recreate: false,
            no_loop_region: false,
            no_chain_fit: false,
            spare_pieces: false,
            contiguous: false,
            no_contiguous: false,
            reserve_slack: None,
            reserve_slack_min: None,
            prealloc: None,
            paranoid: false,
        }
    }

    /// The allocator's configuration: the defaults, with each flag given set. The capacity
    /// limits the allocator on a real GPU only (on sim and host it sizes the device).
    fn config(&self, on_cuda: bool) -> Config {
        let mut c = Config::default()
            .with_stitching(!self.no_stitch)
            .with_paranoid(self.paranoid);
        if let Some(v) = self.small_threshold {
            c = c.with_small_threshold(v);
        }
        if let Some(v) = self.min_handle {
            c.min_handle = Some(v);
        }
        if let Some(v) = self.max_handle {
            c.max_handle = v;
        }
        if let Some(v) = self.handle_divisor {
            c.handle_divisor = v;
        }
        if let Some(v) = self.split_min {
            c.split_min = v;
        }
        c.recreate = !self.no_recreate;
        c.loop_region = !self.no_loop_region;
        c.chain_fit = !self.no_chain_fit;
        c.spare_pieces = self.spare_pieces;
        c.contiguous = self.contiguous || (c.contiguous && !self.no_contiguous);
        if let Some(v) = self.reserve_slack {
            c.reserve_slack = v;
        }
        if let Some(v) = self.reserve_slack_min {
            c.reserve_slack_min = v;
        }
        if let Some(v) = self.prealloc {
            c.prealloc = v;
        }
        if let (Some(b), true) = (self.capacity, on_cuda) {
            c.capacity = Capacity::Bytes(b);
        }
        c
    }
}

#[derive(Args, Clone)]
struct TraceArgs {
    /// The trace: text (`a <id> <bytes> [stream]` / `f <id> [bytes] [stream]`) or a PyTorch
    /// snapshot pickle, either optionally gzipped.
    file: PathBuf,
    /// The trace format.
    #[arg(long, value_enum, default_value = "auto")]
    format: FormatArg,
    /// For PyTorch snapshots: the device whose trace to replay (default: first non-empty).
    #[arg(long)]
    device: Option<usize>,
    /// Exit with status 0 even when allocations failed (by default a failed allocation
    /// makes the exit status 1, after the report).
    #[arg(long)]
    allow_failures: bool,
}

#[derive(Args)]
struct ReplayArgs {
    #[command(flatten)]
    trace: TraceArgs,
    #[command(flatten)]
    alloc: AllocArgs,
    /// Print exactly one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Write an SVG of live and reserved bytes over the replay.
    #[arg(long, value_name = "OUT.svg")]
    plot: Option<PathBuf>,
    /// Skip measuring the stranded bytes at each new peak (faster; reports 0).
    #[arg(long)]
    skip_stranded: bool,
    /// CPU backends: model a GPU running this many events behind the CPU (every
    /// allocation and free queues simulated work on its stream that completes that many
    /// events later), as under a framework whose CPU thread runs ahead of the device.
    #[arg(long, value_name = "EVENTS", default_value_t = 0)]
    gpu_lag: usize,
    /// A JSON file overriding fields of the driver cost model (see `stitch info` for the
    /// defaults), e.g. {"set_access_quadratic": 0.0}.
    #[arg(long, value_name = "FILE.json")]
    cost_model: Option<PathBuf>,
    /// Also replay the trace through models of PyTorch's default caching allocator and of
    /// `expandable_segments:True`, and print what stitch-alloc saves against each.
    #[arg(long)]
    compare: bool,
    /// Write one line per allocation that called the driver: its index among the trace's
    /// allocations, its requested bytes, the mappings it made and removed. Compared with a
    /// history recorded under the C ABI by `scripts/trajectory.py`.
    #[arg(long, value_name = "OUT.txt")]
    calls_log: Option<PathBuf>,
}

#[derive(Args)]
struct GenArgs {
    /// llm, train, checkerboard, adversarial, serve or churn.
    kind: Kind,
    /// The seed: the same seed gives the same trace, byte for byte.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output file (gzipped when it ends in .gz).
    #[arg(long)]
    out: PathBuf,
    /// A scaled-down trace (thousands of events, a few GiB) instead of the full size.
    #[arg(long)]
    small: bool,
}

#[derive(Args)]
struct DemoArgs {
    /// Print the results as one JSON object.
    #[arg(long)]
    json: bool,
    /// The seed of the generated workloads.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The backend. `auto` (the default) runs the workloads on the GPU when one is present
    /// (filling about 129 GB of it), else on the host backend: real host memory remapped with
    /// mmap and memfd, sized like an H200 (139.8 GiB of address space; pages are never
    /// touched, so it costs no RAM). `sim` is the accounting-only simulated H200.
    #[arg(long, default_value = "auto", value_parser = backend_parser(
        "CUDA device 0 when a usable GPU and driver are found, else host memory sized like an H200"))]
    backend: Backend,
    /// The folder of real PyTorch snapshots replayed after the two generated workloads, with
    /// `torch.json` beside them (the figures measured through torch on the GPU, with the runs
    /// and cards they come from). Default: the repository's `tests/data/zoo`.
    #[arg(long)]
    zoo: Option<PathBuf>,
}

#[derive(Args)]
struct InfoArgs {
    #[command(flatten)]
    alloc: AllocArgs,
}

#[derive(Args)]
struct MapArgs {
    #[command(flatten)]
    trace: TraceArgs,
    #[command(flatten)]
    alloc: AllocArgs,
    /// Draw the state after this many events (default: the first peak of live bytes; at
    /// most the trace's length).
    #[arg(long)]
    at: Option<usize>,
    /// Output SVG.
    #[arg(long, value_name = "OUT.svg")]
    out: PathBuf,
}

type Dyn = Metered<Arc<dyn Driver>>;

struct Built {
    /// The CUDA driver under the allocator, when the backend is CUDA (to create real streams
    /// for the trace's stream ids).
    cuda: Option<Arc<CudaDriver>>,
    alloc: Allocator<Dyn>,
    meter: Arc<Meter>,
    describe: String,
    stitching: bool,
    /// CUDA streams made for a trace's stream ids: declared after `alloc`, so they are
    /// destroyed after the allocator (which may record fences on them until its teardown).
    streams: std::cell::RefCell<Vec<CudaStream>>,
}

fn sim_driver(capacity: Option<u64>) -> (Arc<dyn Driver>, String) {
    let sim = SimDriver::with_capacity(capacity.unwrap_or(H200_CAPACITY));
    sim.set_panic_on_leak(false);
    let what = if capacity.is_none() {
        "simulated NVIDIA H200 (accounting only)"
    } else {
        "simulated GPU (accounting only)"
    };
    (Arc::new(sim), what.to_string())
}

fn cuda_driver(backend: Backend) -> Result<(Arc<dyn Driver>, String), String> {
    let d = CudaDriver::new(0).map_err(|e| {
        if backend == Backend::Auto {
            format!("backend auto found no usable CUDA device ({e}); {NO_GPU_HINT}")
        } else {
            format!("the CUDA backend is unavailable ({e}); {NO_GPU_HINT}")
        }
    })?;
    let d = Arc::new(d);
    CUDA.with(|c| *c.borrow_mut() = Some(d.clone()));
    Ok((d, "CUDA device 0".to_string()))
}

thread_local! {
    /// The last CUDA driver made by `cuda_driver` (picked up by `build_with`).
    static CUDA: std::cell::RefCell<Option<Arc<CudaDriver>>> = const { std::cell::RefCell::new(None) };
}

/// Real CUDA streams for a trace's non-zero stream ids (a trace records the raw stream
/// handles of the process that made it, which mean nothing here). `b` keeps the streams
/// until after its allocator is gone.
fn stream_map(b: &Built, t: &Trace) -> Result<std::collections::HashMap<u64, Stream>, String> {
    let mut streams = b.streams.borrow_mut();
    let mut map = std::collections::HashMap::new();
    let Some(cd) = &b.cuda else {
        return Ok(map);
    };
    for e in &t.events {
        if let trace::Event::Alloc { stream, .. }
        | trace::Event::Free {
            stream: Some(stream),
            ..
        } = *e
        {
            if stream != 0 && !map.contains_key(&stream) {
                let s = cd
                    .create_stream(true)
                    .map_err(|e| format!("cannot create a CUDA stream: {e}"))?;
                map.insert(stream, s.stream());
                streams.push(s);
            }
        }
    }
    Ok(map)
}

/// The driver of `a.backend`: `auto` is CUDA or an error (never a CPU backend); `host` is
/// sized like the simulated H200 unless `--capacity` says otherwise.
fn make_driver(a: &AllocArgs) -> Result<(Arc<dyn Driver>, String), String> {
    match a.backend {
        Backend::Cuda | Backend::Auto => cuda_driver(a.backend),
        Backend::Sim => Ok(sim_driver(a.capacity)),
        Backend::Host => {
            // One open file per handle: a device-sized host backend wants the hard limit.
            HostDriver::raise_open_file_limit();
            let h = HostDriver::with_capacity(a.capacity.unwrap_or(H200_CAPACITY))
                .map_err(|e| format!("cannot create the host backend: {e}"))?;
            h.set_panic_on_leak(false);
            Ok((Arc::new(h), "host memory (mmap + memfd)".to_string()))
        }
    }
}

fn build(a: &AllocArgs) -> Result<Built, String> {
    build_with(a, CostModel::default())
}

fn build_with(a: &AllocArgs, cost: CostModel) -> Result<Built, String> {
    CUDA.with(|c| *c.borrow_mut() = None);
    let (drv, describe) = make_driver(a)?;
    let cuda = CUDA.with(|c| c.borrow_mut().take());
    let meter = Meter::new(cost);
    let cfg = a.config(drv.name() == "cuda");
    let alloc = Allocator::new(Metered::new(drv, meter.clone()), cfg)
        .map_err(|e| format!("cannot create the allocator: {e}"))?;
    Ok(Built {
        cuda,
        alloc,
        meter,
        describe,
        stitching: !a.no_stitch,
        streams: Default::default(),
    })
}

impl TraceArgs {
    /// The trace file's name, for picture titles.
    fn name(&self) -> String {
        self.file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// The longest error message printed whole; a longer one (a binary file read as text
/// quotes its "line") is cut.
const MAX_MESSAGE: usize = 120;

/// `msg` cut to about [`MAX_MESSAGE`] characters.
fn cut(msg: String) -> String {
    if msg.chars().count() <= MAX_MESSAGE {
        return msg;
    }
    let head: String = msg.chars().take(MAX_MESSAGE).collect();
    format!("{head}... (cut)")
}

/// A trace and, for a PyTorch snapshot that records its segments, PyTorch's own reserved
/// bytes over it.
struct Loaded {
    trace: Trace,
    pytorch: Option<RecordedReserved>,
}

fn load(t: &TraceArgs) -> Result<Loaded, String> {
    use std::io::{BufRead, BufReader};
    let name = t.file.display();
    let open = || {
        std::fs::File::open(&t.file)
            .map(|f| BufReader::with_capacity(1 << 20, f))
            .map_err(|e| format!("cannot read {name}: {e}"))
    };
    let bad = |e: trace::TraceError| cut(format!("{name}: {e}"));
    // A snapshot (a pickle, gzipped or not) is decoded here as it is read, to get PyTorch's
    // segments too, without holding the file in memory; the format is detected as
    // `trace::read_bytes` does.
    let mut file = open()?;
    let head = file
        .fill_buf()
        .map_err(|e| format!("cannot read {name}: {e}"))?;
    let gz = trace::is_gzip(head);
    let first_plain = head.first().copied();
    let mut gunzip = BufReader::with_capacity(1 << 20, flate2::read::MultiGzDecoder::new(open()?));
    let pickle = match t.format {
        FormatArg::Pytorch => true,
        FormatArg::Text => false,
        FormatArg::Auto if gz => matches!(gunzip.fill_buf(), Ok(b) if b.first() == Some(&0x80)),
        FormatArg::Auto => first_plain == Some(0x80),
    };
    let (trace, pytorch) = if pickle {
        if gz {
            pytorch::read_snapshot(gunzip, t.device).map_err(bad)?
        } else {
            pytorch::read_snapshot(file, t.device).map_err(bad)?
        }
    } else {
        drop((file, gunzip));
        let bytes = std::fs::read(&t.file).map_err(|e| format!("cannot read {name}: {e}"))?;
        let format = match t.format {
            FormatArg::Text => Format::Text,
            _ => Format::Auto,
        };
        let opts = ReadOptions {
            format,
            device: t.device,
        };
        (trace::read_bytes(&bytes, opts).map_err(bad)?, None)
    };
    if !trace
        .events
        .iter()
        .any(|e| matches!(e, trace::Event::Alloc { .. }))
    {
        return Err(format!("{name}: the trace has no allocations"));
    }
    Ok(Loaded { trace, pytorch })
}

/// The number of events after which live bytes first reach their peak.
fn peak_live_event(t: &Trace) -> usize {
    let mut sizes = std::collections::HashMap::new();
    let (mut live, mut peak, mut at) = (0u64, 0u64, 0usize);
    for (i, e) in t.events.iter().enumerate() {
        match *e {
            trace::Event::Alloc { id, bytes, .. } => {
                sizes.insert(id, bytes);
                live += bytes;
                if live > peak {
                    (peak, at) = (live, i + 1);
                }
            }
            trace::Event::Free { id, .. } => live -= sizes.remove(&id).unwrap_or(0),
            _ => {}
        }
    }
    at
}

/// Byte counts as the tables show them: the library's one formatter.
fn gib(b: u64) -> String {
    Bytes(b).to_string()
}

/// The exit status after a replay: 1 when allocations failed, unless allowed.
fn failures(failed: u64, first: Option<&str>, allow: bool) -> Result<ExitCode, String> {
    if failed == 0 || allow {
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!(
        "stitch: {failed} allocation(s) failed (first: {}); exit status 1 (pass \
         --allow-failures to accept failures)",
        first.unwrap_or("?")
    );
    Ok(ExitCode::from(1))
}

fn ms(us: f64) -> String {
    if us >= 1e6 {
        format!("{:.3} s", us / 1e6)
    } else if us >= 1e3 {
        format!("{:.1} ms", us / 1e3)
    } else {
        format!("{us:.0} us")
    }
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn print_report(file: &str, t: &Trace, b: &Built, r: &ReplayReport) {
    let sum = t.summary();
    let c = &r.driver_calls;
    use stitch_alloc::driver::DriverOp as Op;
    out!(
        "trace            {file}: {} events, {} stream(s)",
        thousands(t.op_count() as u64),
        sum.streams
    );
    out!(
        "backend          {} ({}), capacity {}, stitching {}",
        r.backend,
        b.describe,
        gib(r.capacity),
        if b.stitching { "on" } else { "off" }
    );
    out!(
        "events           {} ({} allocs, {} frees, {} failed allocs)",
        thousands(r.events),
        thousands(r.allocs),
        thousands(r.frees),
        r.failed_allocs
    );
    if let Some(e) = &r.first_error {
        out!("first failure    {e}");
    }
    if r.gpu_lag > 0 {
        out!(
            "gpu lag          {} events (simulated); the CPU waited for the device {} times",
            thousands(r.gpu_lag as u64),
            r.event_waits
        );
    }
    out!("peak live        {}", gib(r.peak_live_bytes));
    out!(
        "peak reserved    {}   ratio {:.4}",
        gib(r.peak_reserved_bytes),
        r.ratio
    );
    out!("stranded @ peak  {}", gib(r.stranded_bytes_at_peak));
    if let (Some(torch), Some(saved)) = (r.pytorch_peak_reserved_bytes, r.saved_bytes) {
        let verdict = if saved >= 0 {
            format!("you would save {}", gib(saved.unsigned_abs()))
        } else {
            format!("stitch-alloc would need {} more", gib(saved.unsigned_abs()))
        };
        out!(
            "vs PyTorch       PyTorch reserved {} (ratio {:.4}), stitch-alloc {}: {verdict}",
            gib(torch),
            r.pytorch_ratio.unwrap_or(0.0),
            gib(r.peak_reserved_bytes)
        );
    }
    out!(
        "driver calls     reserve {}, create {}, release {}, map {}, unmap {}, set_access {}; events: record {}, query {}, wait {}",
        c.get(Op::Reserve),
        c.get(Op::Create),
        c.get(Op::Release),
        c.get(Op::Map),
        c.get(Op::Unmap),
        c.get(Op::SetAccess),
        c.get(Op::RecordEvent),
        c.get(Op::QueryEvent),
        c.get(Op::WaitEvent)
    );
    let mut parts: Vec<(&str, f64)> = r
        .modeled_driver_by_call
        .iter()
        .map(|(k, v)| (*k, *v))
        .collect();
    parts.sort_by(|a, b| b.1.total_cmp(&a.1));
    let top: Vec<String> = parts
        .iter()
        .take(4)
        .filter(|p| p.1 > 0.0)
        .map(|(k, v)| format!("{k} {}", ms(*v)))
        .collect();
    out!(
        "modeled driver   {}  ({}; H200 medians)",
        ms(r.modeled_driver_us),
        top.join(", ")
    );
    if let Some(t) = r.modeled_us_per_alloc.filter(|t| t.count > 0) {
        out!(
            "per allocation   {} allocs called the driver: median {}, p99 {}, slowest {} (modeled)",
            thousands(t.count),
            ms(t.p50_us),
            ms(t.p99_us),
            ms(t.max_us)
        );
    }
    for (k, a) in r.slowest_allocs.iter().take(3).enumerate() {
        let calls: Vec<String> = a.calls.iter().map(|(op, n)| format!("{op} {n}")).collect();
        out!(
            "{}{} for {} at event {} ({})",
            if k == 0 {
                "slowest allocs   "
            } else {
                "                 "
            },
            ms(a.modeled_us),
            gib(a.bytes),
            thousands(a.event as u64),
            calls.join(", ")
        );
    }
    let replay_us: f64 = r.modeled_driver_us_by_tenth.iter().sum();
    if replay_us > 0.0 {
        let shares: Vec<String> = r
            .modeled_driver_us_by_tenth
            .iter()
            .map(|t| format!("{:.0}%", 100.0 * t / replay_us))
            .collect();
        out!(
            "by tenth         {} of the modeled driver time in each tenth of the events",
            shares.join(" ")
        );
    }
    out!(
        "stitches         {} (moving {} handles; {} in the state of an earlier one), {} in-place extensions; {} handles created, {} released; {} of {} allocs with no driver call",
        r.stitches,
        r.stitched_handles,
        r.repeated_stitches,
        r.extensions,
        r.handles_created,
        r.handles_released,
        thousands(r.fast_allocs),
        thousands(r.fast_allocs + r.slow_allocs)
    );
    if r.repeated_stitches > 0 {
        let mib = stitch_alloc::stats::prealloc_for_peak(r.peak_live_bytes) >> 20;
        out!(
            "repeats          {} stitches were made at the same point of a step as an earlier one (same request, same live bytes); a pool pre-allocated a little above the peak can end them: try --prealloc {mib}MiB (1.05 x peak live; more if the step fragments more)",
            thousands(r.repeated_stitches)
        );
    }
    for p in &r.probes {
        out!(
            "largest alloc    {} after event {} = {:.2}% of free memory ({}), {:.2}% of reclaimable; first probe alloc {} modeled",
            gib(p.largest_bytes),
            p.event,
            100.0 * p.fraction_of_free,
            gib(p.free_bytes),
            100.0 * p.fraction_of_reclaimable,
            ms(p.first_success_us)
        );
    }
    out!(
        "wall time        {:.1} ms ({:.2} M events/s)",
        r.wall_ms,
        r.events_per_sec / 1e6
    );
}

/// `stitch replay --compare`'s table.
fn print_compare(c: &models::Comparison, peak_live: u64) {
    let saves = |x: i64| {
        if x >= 0 {
            format!("saves {}", gib(x.unsigned_abs()))
        } else {
            format!("needs {} more", gib(x.unsigned_abs()))
        }
    };
    out!();
    out!(
        "compare (peak live {}; models replay the same events, no GPU lag)",
        gib(peak_live)
    );
    out!(
        "  {:<38} {:>14} {:>9}  {}",
        "allocator",
        "peak reserved",
        "/ live",
        "stitch-alloc"
    );
    for row in &c.rows {
        let verdict = if row.allocator == "stitch-alloc" {
            "-".to_string()
        } else {
            saves(row.stitch_saves_bytes)
        };
        let failed = if row.failed_allocs > 0 {
            format!(" ({} failed allocs)", row.failed_allocs)
        } else {
            String::new()
        };
        out!(
            "  {:<38} {:>14} {:>9.4}  {verdict}{failed}",
            row.allocator,
            gib(row.peak_reserved_bytes),
            row.ratio
        );
    }
    if let Some(rec) = &c.recorded {
        out!(
            "  {:<38} {:>14} {:>9.4}  (the snapshot's own figure: the {} model is off by {:+.2}%)",
            "PyTorch as recorded",
            gib(rec.recorded_peak_reserved_bytes),
            if peak_live > 0 {
                rec.recorded_peak_reserved_bytes as f64 / peak_live as f64
            } else {
                0.0
            },
            match rec.model {
                models::Model::PyTorchDefault => "default",
                models::Model::PyTorchExpandable => "expandable",
            },
            rec.model_error_pct
        );
    }
}

fn cmd_replay(a: &ReplayArgs) -> Result<ExitCode, String> {
    let cost = match &a.cost_model {
        None => CostModel::default(),
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| format!("cannot read {}: {e}", p.display()))?;
            serde_json::from_str(&text)
                .map_err(|e| format!("{}: not a cost model: {e}", p.display()))?
        }
    };
    let b = build_with(&a.alloc, cost)?;
    let loaded = load(&a.trace)?;
    let t = loaded.trace;
    let map = stream_map(&b, &t)?;
    let opts = ReplayOptions {
        meter: Some(b.meter.clone()),
        timeline: a.plot.is_some(),
        skip_stranded: a.skip_stranded,
        streams: map,
        gpu_lag: a.gpu_lag,
        ..Default::default()
    };
    let mut r = replay(&t, &b.alloc, &opts);
    r.stitching = Some(b.stitching);
    if let Some(path) = &a.calls_log {
        let mut text = String::from("# alloc bytes maps unmaps\n");
        for c in &r.driver_allocs {
            text += &format!("{} {} {} {}\n", c.alloc, c.bytes, c.maps, c.unmaps);
        }
        std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if let Some(torch) = loaded.pytorch {
        r.set_pytorch_reserved(torch.peak_bytes);
    }
    let cmp = a.compare.then(|| {
        let recorded = loaded
            .pytorch
            .map(|p| (p.peak_bytes, p.expandable_segments));
        models::compare(
            &t,
            r.capacity,
            r.peak_reserved_bytes,
            r.peak_live_bytes,
            r.failed_allocs,
            recorded,
        )
    });
    if b.alloc.driver().name() != "sim" || a.alloc.paranoid {
        if let Err(e) = b.alloc.validate() {
            return Err(format!("allocator invariant broken after replay: {e}"));
        }
    }
    // What the trace leaves live is expected, not a leak of this program's.
    b.alloc.shutdown();
    if let (Some(path), Some(tl)) = (&a.plot, &r.timeline) {
        let name = a.trace.name();
        let title = format!(
            "{name}: peak reserved / peak live = {:.4} (stitching {})",
            r.ratio,
            if b.stitching { "on" } else { "off" }
        );
        std::fs::write(path, plot::timeline_svg(tl, &title))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if a.json {
        let mut v = serde_json::to_value(&r).map_err(|e| e.to_string())?;
        if let Some(o) = v.as_object_mut() {
            o.insert("trace".into(), a.trace.file.display().to_string().into());
            if let Some(c) = &cmp {
                o.insert(
                    "compare".into(),
                    serde_json::to_value(c).map_err(|e| e.to_string())?,
                );
            }
        }
        out!("{v}");
    } else {
        print_report(&a.trace.file.display().to_string(), &t, &b, &r);
        if let Some(p) = &a.plot {
            out!("plot             {}", p.display());
        }
        if let Some(c) = &cmp {
            print_compare(c, r.peak_live_bytes);
        }
    }
    failures(
        r.failed_allocs,
        r.first_error.as_deref(),
        a.trace.allow_failures,
    )
}

fn cmd_gen(a: &GenArgs) -> Result<(), String> {
    let scale = if a.small { Scale::Small } else { Scale::Full };
    let t = gen::generate(a.kind, a.seed, scale);
    t.write_path(&a.out)
        .map_err(|e| format!("cannot write {}: {e}", a.out.display()))?;
    let s = t.summary();
    eprintln!(
        "wrote {}: {} {} trace, seed {}, {} events, peak live {}",
        a.out.display(),
        if a.small { "small" } else { "full" },
        a.kind.name(),
        a.seed,
        thousands(t.op_count() as u64),
        gib(s.peak_live_bytes)
    );
    Ok(())
}

fn cmd_info(a: &InfoArgs) -> Result<(), String> {
    let b = build(&a.alloc)?;
    let d = b.alloc.driver();
    let info = d.mem_info().map_err(|e| e.to_string())?;
    out!("backend      {}", d.name());
    out!("device       {}", b.describe);
    out!(
        "granularity  {} bytes ({})",
        d.granularity(),
        gib(d.granularity())
    );
    out!(
        "capacity     {} bytes ({})",
        b.alloc.capacity(),
        gib(b.alloc.capacity())
    );
    out!("device total {} bytes, free {}", info.total, info.free);
    out!("stitching    {}", if b.stitching { "on" } else { "off" });
    out!(
        "cost model   {} (microseconds; override with replay --cost-model FILE.json)",
        serde_json::to_string(&CostModel::default()).map_err(|e| e.to_string())?
    );
    Ok(())
}

fn cmd_map(a: &MapArgs) -> Result<ExitCode, String> {
    let b = build(&a.alloc)?;
    let t = load(&a.trace)?.trace;
    let at = match a.at {
        None => peak_live_event(&t),
        Some(n) if n <= t.events.len() => n,
        Some(n) => {
            return Err(format!(
                "--at {n} is beyond the trace, which has {} events",
                t.events.len()
            ))
        }
    };
    let map = stream_map(&b, &t)?;
    let opts = ReplayOptions {
        meter: Some(b.meter.clone()),
        stop_after: Some(at),
        streams: map,
        ..Default::default()
    };
    let r = replay(&t, &b.alloc, &opts);
    let snap = b.alloc.snapshot();
    // What the trace leaves live is expected, not a leak of this program's.
    b.alloc.shutdown();
    let name = a.trace.name();
    let title = format!(
        "{name} after {at} events (stitching {})",
        if b.stitching { "on" } else { "off" }
    );
    std::fs::write(&a.out, plot::map_svg(&snap, &title))
        .map_err(|e| format!("cannot write {}: {e}", a.out.display()))?;
    eprintln!(
        "wrote {}: {} runs, {} handles, live {}, reserved {}, stranded {} after {} events{} ({} failed allocs)",
        a.out.display(),
        snap.runs.len(),
        snap.handles.len(),
        gib(snap.detailed.stats.requested.current),
        gib(snap.detailed.stats.reserved.current),
        gib(snap.detailed.stranded_bytes),
        at,
        if a.at.is_none() {
            " (the peak of live bytes)"
        } else {
            ""
        },
        r.failed_allocs
    );
    failures(
        r.failed_allocs,
        r.first_error.as_deref(),
        a.trace.allow_failures,
    )
}

struct DemoRow {
    ratio_on: f64,
    ratio_off: f64,
    reserved_on: u64,
    reserved_off: u64,
    failed_on: u64,
    failed_off: u64,
    us_on: f64,
    us_off: f64,
}

/// `backend` as the demo uses it: `auto` without a usable GPU names the host backend (the
/// demo's one exception to the rule on [`Backend`], printed when taken).
fn demo_backend(backend: Backend) -> Backend {
    if backend == Backend::Auto && !CudaDriver::available() {
        eprintln!(
            "stitch demo: no usable CUDA device ({}); running on the host backend instead \
             (real host memory, sized like an H200). Name --backend cuda to require the GPU.",
            CudaDriver::unavailable_reason().unwrap_or_default()
        );
        return Backend::Host;
    }
    if backend == Backend::Auto {
        return Backend::Cuda;
    }
    backend
}

fn demo_run(t: &Trace, stitching: bool, backend: Backend) -> Result<ReplayReport, String> {
    let b = build(&AllocArgs::defaults(backend, stitching))?;
    let map = stream_map(&b, t)?;
    let opts = ReplayOptions {
        meter: Some(b.meter.clone()),
        streams: map,
        ..Default::default()
    };
    let mut r = replay(t, &b.alloc, &opts);
    r.stitching = Some(stitching);
    b.alloc.shutdown();
    Ok(r)
}

/// One real workload of the demo's zoo section: its snapshot replayed on the simulated H200
/// at GPU lags 0 and 1000 (`None` when the snapshot is not shipped), and the figures measured
/// through torch that `torch.json` records for it.
#[derive(serde::Serialize)]
struct ZooRow {
    workload: String,
    kind: String,
    replay_lag0: Option<f64>,
    replay_lag1000: Option<f64>,
    torch_pytorch_default: f64,
    torch_expandable_segments: f64,
    torch_stitch_alloc: f64,
}

/// The demo's zoo section: every workload `dir/torch.json` lists, its snapshot (when present)
/// replayed through stitch-alloc's default configuration on the simulated H200 (the CPU
/// backends' own handle limits would change the handle sizes, see `Driver::handle_limit`).
fn demo_zoo(dir: &std::path::Path) -> Result<(Vec<ZooRow>, serde_json::Value), String> {
    let path = dir.join("torch.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let doc: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let Some(list) = doc["workloads"].as_object() else {
        return Err(format!("{}: no \"workloads\" object", path.display()));
    };
    let figure = |w: &str, v: &serde_json::Value, k: &str| {
        v[k].as_f64()
            .filter(|x| x.is_finite() && *x >= 1.0)
            .ok_or_else(|| format!("{}: {w}: no ratio \"{k}\" of at least 1", path.display()))
    };
    let mut rows = Vec::new();
    for (w, v) in list {
        let snap = dir.join(format!("{w}.pickle.gz"));
        let (lag0, lag1000) = if snap.exists() {
            let t = trace::read_path(&snap, ReadOptions::default())
                .map_err(|e| format!("{}: {e}", snap.display()))?;
            let run = |lag: usize| -> Result<f64, String> {
                let b = build(&AllocArgs::defaults(Backend::Sim, true))?;
                let opts = ReplayOptions {
                    meter: Some(b.meter.clone()),
                    streams: stream_map(&b, &t)?,
                    gpu_lag: lag,
                    skip_stranded: true,
                    ..Default::default()
                };
                let r = replay(&t, &b.alloc, &opts);
                b.alloc.shutdown();
                match r.first_error {
                    None => Ok(r.ratio),
                    Some(e) => Err(format!("{}: {e}", snap.display())),
                }
            };
            (Some(run(0)?), Some(run(1000)?))
        } else {
            (None, None)
        };
        rows.push(ZooRow {
            workload: w.clone(),
            kind: v["kind"].as_str().unwrap_or("").to_string(),
            replay_lag0: lag0,
            replay_lag1000: lag1000,
            torch_pytorch_default: figure(w, v, "pytorch_default")?,
            torch_expandable_segments: figure(w, v, "expandable_segments")?,
            torch_stitch_alloc: figure(w, v, "stitch_alloc")?,
        });
    }
    let sources = serde_json::json!({
        "pytorch": doc["pytorch_source"], "stitch_alloc": doc["stitch_alloc_source"]
    });
    Ok((rows, sources))
}

/// The geometric mean of `v` (1.0 when empty).
fn geomean(v: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = v.fold((0.0, 0u32), |(s, n), x| (s + x.ln(), n + 1));
    if n == 0 {
        1.0
    } else {
        (sum / f64::from(n)).exp()
    }
}

fn cmd_demo(a: &DemoArgs) -> Result<(), String> {
    let t0 = Instant::now();
    let backend = demo_backend(a.backend);
    let llm = gen::generate(Kind::Llm, a.seed, Scale::Full);
    let cb = gen::generate(Kind::Checkerboard, a.seed, Scale::Full);
    let l_on = demo_run(&llm, true, backend)?;
    let l_off = demo_run(&llm, false, backend)?;
    let c_on = demo_run(&cb, true, backend)?;
    let c_off = demo_run(&cb, false, backend)?;
    let row = DemoRow {
        ratio_on: l_on.ratio,
        ratio_off: l_off.ratio,
        reserved_on: l_on.peak_reserved_bytes,
        reserved_off: l_off.peak_reserved_bytes,
        failed_on: l_on.failed_allocs,
        failed_off: l_off.failed_allocs,
        us_on: l_on.modeled_driver_us,
        us_off: l_off.modeled_driver_us,
    };
    let probe = |r: &ReplayReport| r.probes.last().cloned().unwrap_or_default();
    let (p_on, p_off) = (probe(&c_on), probe(&c_off));
    // What users run today, modeled over the same events on the same capacity.
    let sim = |t: &Trace, m: models::Model| models::simulate(t, m, l_on.capacity);
    let (l_def, l_exp) = (
        sim(&llm, models::Model::PyTorchDefault),
        sim(&llm, models::Model::PyTorchExpandable),
    );
    let (c_def, c_exp) = (
        sim(&cb, models::Model::PyTorchDefault),
        sim(&cb, models::Model::PyTorchExpandable),
    );
    let zoo_dir = a
        .zoo
        .clone()
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/zoo")));
    let zoo = demo_zoo(&zoo_dir);
    if a.json {
        let zoo = match &zoo {
            Ok((rows, sources)) => serde_json::json!({ "workloads": rows, "sources": sources }),
            Err(e) => serde_json::json!({ "error": e }),
        };
        let v = serde_json::json!({
            "llm": { "stitching_on": l_on, "stitching_off": l_off,
                     "pytorch_default_model": l_def, "pytorch_expandable_model": l_exp },
            "checkerboard": { "stitching_on": c_on, "stitching_off": c_off,
                              "pytorch_default_model": c_def, "pytorch_expandable_model": c_exp },
            "zoo": zoo,
        });
        out!("{v}");
        return Ok(());
    }
    let device = if l_on.backend == "sim" {
        "a simulated H200 (139.8 GiB)".to_string()
    } else {
        format!("the {} backend ({})", l_on.backend, gib(l_on.capacity))
    };
    out!("stitch demo: the same workloads replayed on {device}, stitching on and off.");
    out!(
        "Workloads: LLM inference ({} events, KV caches growing by realloc, temporaries freed out of order) and",
        thousands(llm.op_count() as u64)
    );
    out!("the checkerboard (fill 129 GB with 100-300 MiB tensors, free every other one, then ask for the largest tensor).");
    out!();
    out!("{:<44} {:>16} {:>16}", "", "stitching on", "stitching off");
    out!(
        "{:<44} {:>16} {:>16}",
        "LLM: peak reserved",
        gib(row.reserved_on),
        gib(row.reserved_off)
    );
    out!(
        "{:<44} {:>16} {:>16}",
        format!(
            "LLM: peak reserved / peak live ({})",
            gib(l_on.peak_live_bytes)
        ),
        format!("{:.4}", row.ratio_on),
        format!("{:.4}", row.ratio_off)
    );
    for m in [&l_def, &l_exp] {
        out!(
            "{:<44} {:>16} {:>16}",
            format!("LLM: ... {}", m.model.name()),
            format!("{:.4}", m.ratio),
            ""
        );
    }
    out!(
        "{:<44} {:>16} {:>16}",
        "LLM: failed allocations",
        row.failed_on,
        row.failed_off
    );
    out!(
        "{:<44} {:>16} {:>16}",
        "LLM: modeled driver time",
        ms(row.us_on),
        ms(row.us_off)
    );
    out!(
        "{:<44} {:>16} {:>16}",
        "checkerboard: peak reserved / peak live",
        format!("{:.4}", c_on.ratio),
        format!("{:.4}", c_off.ratio)
    );
    for m in [&c_def, &c_exp] {
        out!(
            "{:<44} {:>16} {:>16}",
            format!("checkerboard: ... {}", m.model.name()),
            format!("{:.4}", m.ratio),
            ""
        );
    }
    out!(
        "{:<44} {:>16} {:>16}",
        "checkerboard: failed allocations",
        c_on.failed_allocs,
        c_off.failed_allocs
    );
    out!(
        "{:<44} {:>16} {:>16}",
        "checkerboard: largest allocation that fits",
        gib(p_on.largest_bytes),
        gib(p_off.largest_bytes)
    );
    out!(
        "{:<44} {:>16} {:>16}",
        "checkerboard: ... as % of free memory",
        format!("{:.2}%", 100.0 * p_on.fraction_of_free),
        format!("{:.2}%", 100.0 * p_off.fraction_of_free)
    );
    out!(
        "{:<44} {:>16} {:>16}",
        "checkerboard: modeled time of that alloc",
        ms(p_on.first_success_us),
        ms(p_off.first_success_us)
    );
    out!(
        "{:<44} {:>16} {:>16}",
        "checkerboard: modeled driver time, total",
        ms(c_on.modeled_driver_us),
        ms(c_off.modeled_driver_us)
    );
    out!();
    out!(
        "What you are looking at: the ratio is physical memory held per byte in use (1.0 = no waste; PyTorch's \
         default allocator: 1.317 on a similar trace), the checkerboard rows how much of the free memory one tensor \
         still gets after fragmentation (PyTorch: 99.7% after 230-370 ms stalls) and what its CUDA calls would cost \
         on an H200."
    );
    out!(
        "(Stitching off is stitch-alloc's own baseline: it releases free memory and re-creates it instead of \
         remapping it, which costs more driver time and lets another process take the memory in between.)"
    );
    out!();
    match &zoo {
        Ok((rows, sources)) => demo_zoo_table(rows, sources),
        Err(e) => out!("(real PyTorch workloads skipped: {e}; name the folder with --zoo)"),
    }
    out!(
        "({} s of wall time)",
        format_args!("{:.2}", t0.elapsed().as_secs_f64())
    );
    Ok(())
}

/// The demo's table of real workloads (see [`demo_zoo`]).
fn demo_zoo_table(rows: &[ZooRow], sources: &serde_json::Value) {
    out!("Real PyTorch workloads: peak reserved / peak requested, measured through torch on the GPU (sources below), and the");
    out!("shipped snapshots (PyTorch default's allocation history) replayed here on the simulated H200 at GPU lags 0 / 1000.");
    out!();
    out!(
        "{:<16} {:<10} {:>15} {:>15} {:>15} {:>18}",
        "workload",
        "kind",
        "PyTorch default",
        "expandable",
        "stitch-alloc",
        "replayed here"
    );
    for r in rows {
        out!(
            "{:<16} {:<10} {:>15.4} {:>15.4} {:>15.4} {:>18}",
            r.workload,
            r.kind,
            r.torch_pytorch_default,
            r.torch_expandable_segments,
            r.torch_stitch_alloc,
            match (r.replay_lag0, r.replay_lag1000) {
                (Some(a), Some(b)) => format!("{a:.4} / {b:.4}"),
                _ => "not shipped".to_string(),
            }
        );
    }
    let below = rows
        .iter()
        .filter(|r| r.torch_stitch_alloc < r.torch_expandable_segments)
        .count();
    out!(
        "{:<27} {:>15.4} {:>15.4} {:>15.4}",
        "geometric mean",
        geomean(rows.iter().map(|r| r.torch_pytorch_default)),
        geomean(rows.iter().map(|r| r.torch_expandable_segments)),
        geomean(rows.iter().map(|r| r.torch_stitch_alloc))
    );
    out!(
        "stitch-alloc holds less than expandable segments on {below} of {} (sources: {}; {}).",
        rows.len(),
        sources["pytorch"].as_str().unwrap_or("?"),
        sources["stitch_alloc"].as_str().unwrap_or("?")
    );
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let ok = |r: Result<(), String>| r.map(|()| ExitCode::SUCCESS);
    let r = match &cli.cmd {
        Cmd::Replay(a) => cmd_replay(a),
        Cmd::Gen(a) => ok(cmd_gen(a)),
        Cmd::Demo(a) => ok(cmd_demo(a)),
        Cmd::Info(a) => ok(cmd_info(a)),
        Cmd::Map(a) => cmd_map(a),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("stitch: error: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn alloc_args(args: &[&str]) -> AllocArgs {
        let argv = ["stitch", "info"].iter().chain(args);
        match Cli::try_parse_from(argv).unwrap().cmd {
            Cmd::Info(i) => i.alloc,
            _ => unreachable!(),
        }
    }

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn flags_set_config_fields() {
        let a = alloc_args(&[]);
        assert_eq!(a.backend, Backend::Sim);
        assert_eq!(a.config(false), Config::default());
        let a = alloc_args(&[
            "--backend=sim",
            "--capacity=1MB",
            "--no-stitch",
            "--min-handle=4MiB",
            "--max-handle=64M",
            "--reserve-slack=0.5",
            "--reserve-slack-min=1.5GiB",
            "--paranoid",
        ]);
        assert_eq!(a.backend, Backend::Sim);
        // The one size parser: SI units are powers of 1000, as in STITCH_ALLOC_CONF.
        assert_eq!(a.capacity, Some(1_000_000));
        assert_eq!(a.capacity, parse_size("1MB").ok());
        let want = Config::default()
            .with_stitching(false)
            .with_handle_sizes(4 << 20, 64 << 20)
            .with_reserve_slack(0.5, 3 << 29)
            .with_paranoid(true);
        assert_eq!(a.config(false), want);
        assert_eq!(
            a.config(true),
            want.with_capacity(Capacity::Bytes(1_000_000))
        );
        for bad in [
            &["--capacity=12 parsecs"][..],
            &["--max-handle=99999999999999TiB"],
            &["--backend=tpu"],
        ] {
            assert!(
                Cli::try_parse_from(["stitch", "info"].iter().chain(bad)).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn help_names_the_config_defaults() {
        let help = Cli::command()
            .find_subcommand_mut("replay")
            .unwrap()
            .render_help()
            .to_string();
        assert!(help.contains("Config::max_handle; default 8 MiB"), "{help}");
        assert!(help.contains("Config::reserve_slack; default 0"), "{help}");
        assert!(
            help.contains("Config::reserve_slack_min; default 0)"),
            "{help}"
        );
    }
}
