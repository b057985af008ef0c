//! The C ABI from C: compiles `tests/capi/test_capi.c` with the system C compiler against
//! `include/stitch_alloc.h` and the crate's cdylib, then runs it on the host backend (real,
//! writable memory: no GPU needed).
//!
//! How it finds the library: the crate is `crate-type = ["rlib", "cdylib"]`, so building the
//! library for this test (which `cargo test` always does first) also links
//! `libstitch_alloc.so` into `target/<profile>/deps/`, the folder of this test's executable
//! (`cargo build` copies it up to `target/<profile>/` as well). The C program is linked with
//! `-L <that folder> -lstitch_alloc -Wl,-rpath,<that folder>` and written to
//! `CARGO_TARGET_TMPDIR`. The C compiler is `$CC` or `cc` (Rust's own linker on Linux, so it
//! is there wherever this crate builds).
//!
//! Each scenario runs in its own process: `STITCH_ALLOC_CONF` is read once per process.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn cdylib_name() -> String {
    format!(
        "{}stitch_alloc{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    )
}

/// The folder holding the cdylib built with this test.
fn cdylib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("executable folder").to_path_buf();
    let candidates = [deps.clone(), deps.parent().unwrap_or(&deps).to_path_buf()];
    for dir in &candidates {
        if dir.join(cdylib_name()).is_file() {
            return dir.clone();
        }
    }
    panic!(
        "{} not found in {:?}: is crate-type cdylib still in Cargo.toml?",
        cdylib_name(),
        candidates
    );
}

/// Whether the source tree this test was built from is here. A test executable copied to
/// another machine (`scripts/gpu-check.sh`) has neither the C source nor the cdylib beside it:
/// it skips, saying so. In the source tree a missing cdylib is a failure.
fn source_tree(test: &str) -> bool {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/capi/test_capi.c");
    if src.is_file() {
        return true;
    }
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED (no source tree: {} is missing): {test}",
        src.display()
    );
    false
}

/// The compiled C test (built once per test process).
fn c_test() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let lib = cdylib_dir();
        // Cargo creates this folder on the build machine; where the test binary runs
        // elsewhere (the GPU bundle) it may not exist yet.
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        std::fs::create_dir_all(tmp).expect("create the temporary folder for the C test");
        let out = tmp.join("test_capi");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
        let mut cmd = Command::new(&cc);
        cmd.args([
            "-std=c99",
            "-D_POSIX_C_SOURCE=200809L",
            "-Wall",
            "-Wextra",
            "-Werror",
        ])
        .arg("-I")
        .arg(root.join("include"))
        .arg(root.join("tests/capi/test_capi.c"))
        .arg("-o")
        .arg(&out)
        .arg("-L")
        .arg(&lib)
        .arg("-lstitch_alloc")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lpthread");
        let o = cmd
            .output()
            .unwrap_or_else(|e| panic!("could not run the C compiler {cc:?}: {e}"));
        assert!(
            o.status.success(),
            "compiling test_capi.c failed: {cmd:?}\n{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        out
    })
}

/// Runs the C test with `conf`; returns (success, stdout, stderr).
fn run(args: &[&str], conf: &str) -> (bool, String, String) {
    let o = Command::new(c_test())
        .args(args)
        .env("STITCH_ALLOC_CONF", conf)
        .output()
        .expect("run test_capi");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    println!(
        "--- STITCH_ALLOC_CONF={conf} test_capi {args:?}: {}",
        o.status
    );
    println!("{out}");
    println!("--- stderr\n{err}");
    (o.status.success(), out, err)
}

/// Runs the C test with `conf` and requires it to pass (exit 0, no failed check); returns
/// (stdout, stderr).
fn run_passing(args: &[&str], conf: &str) -> (String, String) {
    let (ok, out, err) = run(args, conf);
    assert!(ok, "{conf}: the C test failed:\n{out}\n{err}");
    assert!(out.contains(" passed, 0 failed"), "{out}");
    (out, err)
}

#[test]
fn c_abi_normal_use_and_bad_inputs() {
    if !source_tree("c_abi_normal_use_and_bad_inputs") {
        return;
    }
    let (out, err) = run_passing(
        &["main"],
        "backend:host,capacity_bytes:256MiB,devices:2,log:warn,max_handle:64MiB",
    );
    // The failures were logged (log:warn), not only kept as last errors.
    assert!(err.contains("double free"), "stderr: {err}");
    assert!(err.contains("zero-size") || !err.contains("DEBUG"), "{err}");

    // The statistics JSON parses, with PyTorch's names and ours.
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("STATS_JSON "))
        .expect("a STATS_JSON line");
    let v: serde_json::Value = serde_json::from_str(line).expect("stats JSON parses");
    assert_eq!(v["backend"], "host");
    assert_eq!(v["device"], 0);
    assert_eq!(v["initialized"], true);
    assert_eq!(v["capacity"], 256u64 << 20);
    let t = &v["torch"];
    assert_eq!(t["allocated_bytes.all.current"], 0);
    assert!(t["allocated_bytes.all.peak"].as_u64().unwrap() >= 80 << 20);
    assert_eq!(
        t["reserved_bytes.all.current"], 0,
        "empty_cache released all"
    );
    assert!(t["reserved_bytes.all.peak"].as_u64().unwrap() >= 80 << 20);
    assert_eq!(t["allocation.all.current"], 0);
    assert!(t["num_device_alloc"].as_u64().unwrap() > 0);
    assert!(v["stats"]["stitches"].is_u64());
    assert!(v["fragmentation"]["stranded_bytes"].is_u64());
    assert_eq!(v["stats"]["allocs"], v["stats"]["frees"]);
    assert!(v["driver_calls"].as_u64().unwrap() > 0);
}

#[test]
fn c_abi_rejects_bad_configurations() {
    if !source_tree("c_abi_rejects_bad_configurations") {
        return;
    }
    for (conf, needle) in [
        ("backend:host,bogus_key:1", "unknown key \"bogus_key\""),
        ("backend:gpu", "backend"),
        ("backend:host,max_handle:12XB", "max_handle"),
        ("backend:host,capacity_fraction:2", "capacity_fraction"),
        ("backend:host,log", "not of the form key:value"),
    ] {
        let (_, err) = run_passing(&["badconf", needle], conf);
        // Said once on stderr, whatever the log level.
        let said = err
            .matches("stitch-alloc: invalid STITCH_ALLOC_CONF")
            .count();
        assert_eq!(said, 1, "{conf}: stderr: {err}");
    }
}

#[test]
fn c_abi_sim_backend_and_quiet_log() {
    if !source_tree("c_abi_sim_backend_and_quiet_log") {
        return;
    }
    let (_, err) = run_passing(&["sim"], "backend:sim,log:off");
    assert!(err.is_empty(), "log:off prints nothing: {err}");
}

#[test]
fn c_abi_on_oom_abort() {
    if !source_tree("c_abi_on_oom_abort") {
        return;
    }
    let (ok, out, err) = run(&["sim"], "backend:sim,on_oom:abort,log:error");
    assert!(!ok, "the process should abort:\n{out}");
    assert!(
        err.contains("aborting (on_oom:abort)") && err.contains("out of memory"),
        "stderr: {err}"
    );
}

#[test]
fn c_abi_fails_cleanly_in_a_forked_child() {
    if !source_tree("c_abi_fails_cleanly_in_a_forked_child") {
        return;
    }
    let (out, err) = run_passing(&["fork"], "backend:host,capacity_bytes:256MiB,log:warn");
    assert!(out.contains("children: 20 clean"), "{out}");
    // Each child said it once on stderr.
    assert!(err.contains("used in a forked child"), "{err}");
}

#[test]
fn c_abi_ipc_between_two_processes() {
    if !source_tree("c_abi_ipc_between_two_processes") {
        return;
    }
    let (out, _) = run_passing(
        &["ipc"],
        "backend:host,capacity_bytes:256MiB,log:warn,max_handle:4MiB",
    );
    assert!(out.contains("ok   child: sees the parent's bytes"), "{out}");
    assert!(out.contains("ok   parent: sees the child's bytes"), "{out}");
}
