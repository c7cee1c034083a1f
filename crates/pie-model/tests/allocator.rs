//! `keep_freed_memory` in a process of its own: the resident set is the
//! whole process's, so no other test may allocate beside this one.

#![cfg(all(target_os = "linux", target_env = "gnu"))]

/// This process's resident memory, in bytes.
fn resident() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("proc status");
    let kb: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .expect("VmRSS in kB");
    kb << 10
}

/// Resident bytes a 16 MiB buffer, written and freed, leaves behind.
fn left_after_freeing() -> isize {
    let before = resident();
    let buffer = std::hint::black_box(vec![1u8; 16 << 20]);
    drop(buffer);
    resident() as isize - before as isize
}

#[test]
fn freed_buffers_stay_resident_for_reuse() {
    // glibc's default maps a buffer this large on its own and unmaps it on
    // free: nothing stays.
    assert!(
        left_after_freeing() < 2 << 20,
        "the default allocator returned the buffer"
    );
    pie_model::allocator::keep_freed_memory();
    let kept = left_after_freeing();
    assert!(
        kept > 14 << 20,
        "only {kept} bytes of 16 MiB stayed resident"
    );
    // The next buffer of the size reuses it rather than growing the process.
    assert!(
        left_after_freeing() < 2 << 20,
        "a second buffer grew the process"
    );
}
