//! Defaults of `pie-pool` that the simulator models too, named once.

/// `[pool] high_watermark`: eviction starts above this share of the capacity.
pub const HIGH_WATERMARK: f64 = 0.9;
/// `[pool] low_watermark`: eviction stops at this share.
pub const LOW_WATERMARK: f64 = 0.8;
