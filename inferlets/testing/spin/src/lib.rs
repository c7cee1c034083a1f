//! Test inferlet `spin`: computes forever without calling the host, for
//! the host's fuel/epoch preemption tests. No args.

fn run() -> Result<(), String> {
    let mut x: u64 = 1;
    loop {
        x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1));
    }
}

pie_inferlet::main!(run);
