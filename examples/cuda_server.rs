//! A Rust server's use of stitch-alloc on a real GPU: `Allocator<CudaDriver>` serving
//! requests on two CUDA streams made with cudarc; each request copies its input into a
//! stitch-alloc buffer asynchronously, runs a kernel on it (hand-written PTX loaded with
//! cudarc's module API), copies the result out, checks it, and frees the buffer on its
//! stream. The statistics are printed at the end.
//!
//! `cargo run --release --example cuda_server` (needs an NVIDIA GPU and driver; without one
//! it says so and exits with status 2). Run on the GPU by `scripts/gpu-session.sh suite`.
//!
//! The conversion to cudarc: a buffer's address, `buf.ptr().addr()`, is the `CUdeviceptr`
//! that cudarc's raw (`cudarc::driver::result`) calls and kernel arguments take; a cudarc
//! stream enters the allocator as `unsafe { Stream::from_raw(s.cu_stream() as u64) }`.
use cudarc::driver::{result, CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use std::process::ExitCode;
use stitch_alloc::{Allocator, AnyDriver, Config, CudaDriver, Driver, Stream};

/// `add_one(u32* data, u32 n)`: data[i] += 1 for i < n.
const PTX: &str = r#"
.version 8.0
.target sm_80
.address_size 64
.visible .entry add_one(.param .u64 data, .param .u32 n)
{
    .reg .pred p;
    .reg .b32 r<7>;
    .reg .b64 rd<5>;
    ld.param.u64 rd1, [data];
    ld.param.u32 r1, [n];
    mov.u32 r2, %ctaid.x;
    mov.u32 r3, %ntid.x;
    mov.u32 r4, %tid.x;
    mad.lo.s32 r5, r2, r3, r4;
    setp.ge.u32 p, r5, r1;
    @p bra DONE;
    cvta.to.global.u64 rd2, rd1;
    mul.wide.u32 rd3, r5, 4;
    add.s64 rd4, rd2, rd3;
    ld.global.u32 r6, [rd4];
    add.u32 r6, r6, 1;
    st.global.u32 [rd4], r6;
DONE:
    ret;
}
"#;

fn main() -> ExitCode {
    // The one backend rule: `auto` is a GPU or an error that says why (never a fake one).
    if let Err(e) = AnyDriver::auto() {
        eprintln!("cuda_server: needs a GPU: {e}");
        return ExitCode::from(2);
    }
    match serve() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cuda_server: {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve() -> Result<(), Box<dyn std::error::Error>> {
    // cudarc and stitch-alloc share device 0's primary context.
    let ctx = CudaContext::new(0)?;
    let streams = [ctx.new_stream()?, ctx.new_stream()?];
    let module = ctx.load_module(Ptx::from_src(PTX))?;
    let add_one = module.load_function("add_one")?;

    let alloc = Allocator::new(CudaDriver::new(0)?, Config::default())?;
    println!(
        "allocator on {} (capacity {})",
        alloc.driver().name(),
        stitch_alloc::stats::Bytes(alloc.capacity())
    );

    // Requests of 1 KiB to 256 MiB, alternating between the two streams.
    let sizes: Vec<usize> = (0..24).map(|i| 256usize << (i % 21)).collect();
    for (i, &n) in sizes.iter().enumerate() {
        let cu = &streams[i % 2];
        // SAFETY: a live stream of device 0's primary context (the allocator's context),
        // kept alive by `streams` until after `alloc` is dropped.
        let stream = unsafe { Stream::from_raw(cu.cu_stream() as u64) };
        let bytes = (n * 4) as u64;
        let buf = alloc.alloc_buffer(bytes, stream)?;
        let dptr = buf.ptr().addr();
        let input: Vec<u32> = (0..n as u32).collect();
        let mut output = vec![0u32; n];
        // SAFETY: `dptr` is `bytes` bytes of device memory owned by `buf`; `input` lives
        // until the stream is synchronised below.
        unsafe { result::memcpy_htod_async(dptr, &input, cu.cu_stream()) }?;
        let count = n as u32;
        let mut launch = cu.launch_builder(&add_one);
        launch.arg(&dptr).arg(&count);
        // SAFETY: the kernel's parameters are (u64 pointer, u32 count) as pushed, and it
        // touches only data[0..count], inside the buffer.
        unsafe { launch.launch(LaunchConfig::for_num_elems(count)) }?;
        // SAFETY: `output` has room for the buffer's bytes and lives until the sync.
        unsafe { result::memcpy_dtoh_async(&mut output, dptr, cu.cu_stream()) }?;
        cu.synchronize()?;
        if let Some(bad) = (0..n).find(|&k| output[k] != k as u32 + 1) {
            return Err(format!("request {i}: element {bad} is {}", output[bad]).into());
        }
        // `buf` is freed here, on its stream: reusable at once by that stream, by the other
        // only once an event recorded now has completed.
    }
    println!("{} requests served and checked", sizes.len());
    println!("{}", alloc.detailed_stats());
    Ok(())
}
