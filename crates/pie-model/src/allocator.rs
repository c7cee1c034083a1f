//! How the process's allocator keeps the forward pass's freed memory.
//!
//! Every layer of a forward allocates buffers of megabytes (a prefill's
//! matmul outputs, its quantised activations, attention's per-unit state)
//! and frees them before the next layer asks again for the same sizes.
//! glibc's defaults hand such memory back to the kernel: a chunk above its
//! mmap threshold is unmapped on free, and a heap's free top is trimmed.
//! The next layer then takes a page fault per 4 KiB and the kernel zeroes
//! each page, work the matmul does not need (the kernel writes every value).
//! On the Qwen3-0.6B-shaped file a 512-token prefill ran 1.08-1.37x faster
//! (six pairs of runs) with the memory kept; see docs/benchmarks/models.md.

/// Tells glibc to keep freed memory for reuse: no chunk is served by its own
/// mapping (a thread arena still maps one it cannot hold), and a heap's free
/// top is never trimmed. Peak memory is unchanged (the same buffers are
/// live at the peak); what changes is that freed memory stays resident until
/// it is reused. Call once, before the model is loaded. Elsewhere than
/// glibc, a no-op.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets allocator parameters; both values are in
    // range for their parameters.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
    }
}
