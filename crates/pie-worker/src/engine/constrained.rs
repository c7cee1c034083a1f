//! The constrained sequences of a step: their masks are computed on a
//! helper thread while the engine thread runs the batch's forward pass, so a
//! constrained sequence does not hold the batch back (unless its mask takes
//! longer than the whole forward). A constraint that fails (a grammar that
//! allows no next token, a panic in the library) fails its own sequence.

use std::collections::HashMap;
use std::time::Duration;

use pie_core::SeqId;
use pie_model::Constraint;

/// Constraints taken out of their sequences for the step, keyed by sequence.
pub(super) type Taken = Vec<(SeqId, Box<Constraint>)>;

/// What the helper thread gives back.
#[derive(Default)]
pub(super) struct Masked {
    /// Constraints to put back, each with its mask computed.
    pub ready: Vec<(SeqId, Box<Constraint>)>,
    /// Sequences whose constraint failed, with why.
    pub failed: HashMap<SeqId, String>,
    /// How long each mask took.
    pub times: Vec<Duration>,
}

/// Run `forward` on this thread while the masks of `taken` are computed on
/// another; the forward's result and the masks.
pub(super) fn overlapped<T>(taken: Taken, forward: impl FnOnce() -> T) -> (T, Masked) {
    if taken.is_empty() {
        return (forward(), Masked::default());
    }
    let ids: Vec<SeqId> = taken.iter().map(|(id, _)| *id).collect();
    std::thread::scope(|s| {
        let masks = std::thread::Builder::new()
            .name("pie-masks".into())
            .spawn_scoped(s, move || compute(taken));
        let result = forward();
        let masked = match masks.map(|h| h.join()) {
            Ok(Ok(masked)) => masked,
            _ => lost(&ids),
        };
        (result, masked)
    })
}

fn compute(taken: Taken) -> Masked {
    let mut masked = Masked::default();
    for (id, mut constraint) in taken {
        match constraint.compute_mask() {
            Ok(took) => {
                masked.times.push(took);
                masked.ready.push((id, constraint));
            }
            Err(e) => {
                masked
                    .failed
                    .insert(id, format!("constrained generation: {e}"));
            }
        }
    }
    masked
}

/// The mask thread could not start or panicked: its sequences fail, never
/// sampling unconstrained.
fn lost(ids: &[SeqId]) -> Masked {
    Masked {
        failed: (ids.iter())
            .map(|id| {
                (
                    *id,
                    "constrained generation: the mask computation failed".into(),
                )
            })
            .collect(),
        ..Masked::default()
    }
}
