use stitch_alloc::driver::SimDriver;
use stitch_alloc::*;
fn main() {
    let a = Allocator::new(SimDriver::with_capacity(256 << 20), Config::default()).unwrap();
    let p = a.alloc(1048577, Stream(1)).unwrap();
    a.free(p, Stream(1)).unwrap();
    println!("{}", a.snapshot_json());
    let r = a.empty_cache().unwrap();
    println!("released {r}");
    println!("{}", a.snapshot_json());
}
