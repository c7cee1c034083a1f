//! Cephes' single-precision `exp` polynomial, shared by the vector kernels.

pub const LOG2E: f32 = std::f32::consts::LOG2_E;
pub const LN2_HI: f32 = 0.693_359_4;
pub const LN2_LO: f32 = -2.121_944_4e-4;
pub const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];
/// Inputs are clamped here first (the result of `exp(-87.3)` is ~1e-38).
pub const LO: f32 = -87.3;
pub const HI: f32 = 88.0;
