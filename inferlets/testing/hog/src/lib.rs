//! Test inferlet `hog`: allocates memory without bound (1 MiB blocks, every
//! byte written, all kept) until an allocation fails, then returns an error
//! saying how much it got. A host whose memory limit traps instead ends it
//! there. No args.

const MIB: usize = 1 << 20;

fn run() -> Result<(), String> {
    let mut blocks: Vec<Vec<u8>> = Vec::new();
    loop {
        let mut block = Vec::new();
        if blocks.try_reserve(1).is_err() || block.try_reserve_exact(MIB).is_err() {
            break;
        }
        block.resize(MIB, 0xA5);
        blocks.push(std::hint::black_box(block));
    }
    let got = std::hint::black_box(&blocks).len();
    Err(format!("allocation failed after {got} MiB"))
}

pie_inferlet::main!(run);
